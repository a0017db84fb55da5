"""DeepSeek V4 recipes: plain functions returning a Config; derive by calling and editing.

The family trains whole rows (packed or not) under FSDP, expert and Ulysses sequence
parallelism, optionally with multi-token-prediction depths, and decodes with the growing KV
cache; context parallelism is not built yet (docs/models.md).
"""

from __future__ import annotations

from temper.config import ActivationCheckpoint, Config, Model
from temper.recipes.shapes import debug_pretrain, gpu_sft


def deepseek_v4_debug() -> Config:
    """The debug model (one sliding, two CSA and one HCA layer, a hash-routed then top-k MoE
    layers, 4 residual streams) on the built-in synthetic tasks; trains on a CPU. At 256
    tokens, CSA keeps 8 of up to 64 compressed entries per query and HCA reads up to 16."""
    return debug_pretrain(Model(name="deepseek_v4", flavor="debug"))


def deepseek_v4_debug_mtp() -> Config:
    """The debug model with one multi-token-prediction depth trained jointly (weight 0.3):
    logs ``mtp_loss`` and ``mtp_accuracy``, the draft's next-token accuracy."""
    config = deepseek_v4_debug()
    config.job.dump_folder = "./outputs/deepseek_v4_debug_mtp"
    config.model.mtp_depth = 1
    return config


def deepseek_v4_flash_sft() -> Config:
    """SFT of DeepSeek-V4-Flash in bf16 on 128 GPUs (`NNODES=16 NGPU=8`): experts over 64 EP
    ranks (4 each), FSDP over all, full activation checkpointing, 4096-token packed chat rows,
    the indexer as released. Point `--model.hf_path` at the HF folder and `--data.path` at a
    chat JSONL file.

    The dry run (this layout) puts each rank's peak at about 50 GiB (33 GiB of weights,
    gradients and AdamW state, 14 GiB of activations); not run on GPUs yet."""
    return gpu_sft(
        "deepseek_v4_flash_sft",
        Model(name="deepseek_v4", flavor="flash"),
        ep=64,
        global_batch_size=128,
        checkpoint=ActivationCheckpoint(mode="full"),
    )
