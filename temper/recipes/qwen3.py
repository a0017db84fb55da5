"""Qwen3 and Qwen3-MoE recipes: plain functions returning a Config; derive by calling and editing.

The real sizes start from random weights unless `--model.hf_path` names a local HF folder
(whose config.json then sets the architecture), which is how they are meant to be used.
"""

from __future__ import annotations

from temper.config import Config, Model
from temper.recipes.shapes import debug_pretrain, gpu_pretrain


def qwen3_debug() -> Config:
    """A ~4.5M-parameter Qwen3 on the built-in synthetic tasks; trains on a CPU in a minute."""
    return debug_pretrain(Model(name="qwen3", flavor="debug"))


def qwen3_moe_debug() -> Config:
    """An ~8M-parameter Qwen3-MoE (8 experts, top 2, layer 0 dense) on the synthetic tasks."""
    config = qwen3_debug()
    config.job.dump_folder = "./outputs/qwen3_moe_debug"
    config.model = Model(name="qwen3_moe", flavor="debug")
    return config


def qwen3_8b() -> Config:
    """Qwen3-8B in bf16 at 4096 tokens, 128 sequences (0.5M tokens) per optimizer step on GPUs;
    FSDP shards over every rank, with accumulation making up the global batch."""
    return gpu_pretrain("qwen3_8b", Model(name="qwen3", flavor="8b"), global_batch_size=128)


def qwen3_30b_a3b() -> Config:
    """Qwen3-30B-A3B in bf16 at 8192 tokens, 64 sequences (0.5M tokens) per optimizer step on
    GPUs; the router's load-balancing loss is weighted by the model's router_aux_loss_coef."""
    config = qwen3_8b()
    config.job.dump_folder = "./outputs/qwen3_30b_a3b"
    config.model = Model(name="qwen3_moe", flavor="30b_a3b")
    config.training.seq_len = 8192
    config.training.global_batch_size = 64
    return config
