"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next recipes (Gated DeltaNet hybrids).

The real sizes start from random weights unless `--model.hf_path` names a local HF folder of
the language model (`Qwen3_5MoeForCausalLM` and friends), whose config.json then sets the
architecture.
"""

from __future__ import annotations

from temper.config import ActivationCheckpoint, Config, Model
from temper.recipes.qwen3 import qwen3_debug
from temper.recipes.shapes import gpu_sft


def qwen3_5_debug() -> Config:
    """A ~1.4M-parameter dense Qwen3.5 (3 Gated DeltaNet layers, 1 attention) on the built-in
    synthetic tasks; trains on a CPU in a minute."""
    config = qwen3_debug()
    config.job.dump_folder = "./outputs/qwen3_5_debug"
    config.model = Model(name="qwen3_5", flavor="debug")
    return config


def qwen3_5_moe_debug() -> Config:
    """A ~1.7M-parameter Qwen3.5-MoE (8 experts, top 2, gated shared expert) on the synthetic
    tasks."""
    config = qwen3_5_debug()
    config.job.dump_folder = "./outputs/qwen3_5_moe_debug"
    config.model = Model(name="qwen3_5_moe", flavor="debug")
    return config


def qwen3_next_debug() -> Config:
    """A Qwen3-Next debug model (fused Gated DeltaNet projections, layer 0 dense)."""
    config = qwen3_5_debug()
    config.job.dump_folder = "./outputs/qwen3_next_debug"
    config.model = Model(name="qwen3_next", flavor="debug")
    return config


def qwen3_5_35b_a3b_sft() -> Config:
    """SFT of Qwen3.5-35B-A3B in bf16 on GPUs: experts over 8 EP ranks (the shared expert stays
    with its block), FSDP over all ranks, full activation checkpointing, 4096-token packed
    chat rows, 64 sequences per step. Point `--model.hf_path` at the language model's HF folder
    and `--data.path` at a chat JSONL file."""
    return gpu_sft(
        "qwen3_5_35b_a3b_sft",
        Model(name="qwen3_5_moe", flavor="35b_a3b"),
        ep=8,
        global_batch_size=64,
        checkpoint=ActivationCheckpoint(mode="full"),
    )
