"""Recipes for the precision schemes (docs/precision.md): each a debug recipe with one scheme
on. On a CPU, or a GPU without float8 tensor cores, add ``--quantize.float8.emulate`` to
the FP8 recipe."""

from __future__ import annotations

from temper.config import Config
from temper.recipes.llama3 import llama3_debug
from temper.recipes.posttrain import sft_debug


def llama3_debug_float8() -> Config:
    """The debug Llama with its blocks' linear layers trained in FP8 (tensorwise scales, the
    weights all-gathered in float8 under FSDP2)."""
    config = llama3_debug()
    config.job.dump_folder = "./outputs/llama3_debug_float8"
    config.quantize.float8.enable = True
    config.quantize.float8.fsdp_all_gather = True
    return config


def llama3_debug_adamw8bit() -> Config:
    """The debug Llama trained by AdamW with 8-bit moments (a quarter of AdamW's state)."""
    config = llama3_debug()
    config.job.dump_folder = "./outputs/llama3_debug_adamw8bit"
    config.optimizer.name = "adamw8bit"
    return config


def sft_debug_qat() -> Config:
    """Chat SFT through int4-weight, int8-activation fake quantization, for an int4 export
    (``temper.quantize.load_quantized`` on its HF folder)."""
    config = sft_debug()
    config.job.dump_folder = "./outputs/sft_debug_qat"
    config.qat.enable = True
    return config


def sft_debug_qlora() -> Config:
    """Chat SFT with LoRA adapters over an NF4 base (QLoRA); with NGPU=2 (or more) FSDP2 shards
    the NF4 base by rows."""
    config = sft_debug()
    config.job.dump_folder = "./outputs/sft_debug_qlora"
    config.lora.enable = True
    config.lora.quantize_base = "nf4"
    return config
