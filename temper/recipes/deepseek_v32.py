"""DeepSeek Sparse Attention recipes (DeepSeek V3.2, `deepseek_v32`; GLM-5, `glm_moe_dsa`):
plain functions returning a Config; derive by calling and editing.

The debug models train from random weights with ``indexer_training`` ``sparse``: each query
attends to its 64 best keys of 256, and the indexer learns the main attention's
distribution by its KL term (logged as ``indexer_kl``). Fine-tuning a released model keeps
the default ``off`` (the indexer as released; ``--model.hf_path`` names the folder).
"""

from __future__ import annotations

from temper.config import ActivationCheckpoint, Config, Model
from temper.recipes.shapes import debug_pretrain, gpu_sft


def deepseek_v32_debug() -> Config:
    """A ~7.9M-parameter DeepSeek V3.2 (DeepSeek V3's debug model plus a 4-head indexer
    keeping 64 keys per query) on the built-in synthetic tasks, the indexer trained by its
    KL term; trains on a CPU."""
    return debug_pretrain(Model(name="deepseek_v32", flavor="debug", indexer_training="sparse"))


def glm_moe_dsa_debug() -> Config:
    """The same debug model as GLM-5 (its indexer's rotary in interleaved pairs)."""
    config = deepseek_v32_debug()
    config.job.dump_folder = "./outputs/glm_moe_dsa_debug"
    config.model.name = "glm_moe_dsa"
    return config


def deepseek_v32_671b_sft() -> Config:
    """SFT of DeepSeek-V3.2-Exp in bf16 on 256 GPUs (`NNODES=32 NGPU=8`): experts over 64 EP
    ranks, FSDP over all, full activation checkpointing, 4096-token packed chat rows, the
    indexer as released (``indexer_training`` off). Point `--model.hf_path` at the HF
    folder and `--data.path` at a chat JSONL file.

    The dry run (`temper.plan`, this layout) puts each rank's peak at about 56 GiB (39 GiB of
    weights, gradients and AdamW state); the reference attention's dense masks make 8192-token
    rows cost 62 GiB."""
    return gpu_sft(
        "deepseek_v32_671b_sft",
        Model(name="deepseek_v32", flavor="671b"),
        ep=64,
        global_batch_size=256,
        checkpoint=ActivationCheckpoint(mode="full"),
    )


def glm_moe_dsa_744b_sft() -> Config:
    """SFT of GLM-5 with the same layout (256 GPUs, EP 64, full activation checkpointing,
    4096 tokens); the dry run's peak is about 59 GiB per rank (43 GiB of state)."""
    config = deepseek_v32_671b_sft()
    config.job.dump_folder = "./outputs/glm_moe_dsa_744b_sft"
    config.model = Model(name="glm_moe_dsa", flavor="744b")
    return config
