"""DeepSeek Sparse Attention recipes (DeepSeek V3.2, `deepseek_v32`; GLM-5, `glm_moe_dsa`):
plain functions returning a Config; derive by calling and editing.

The debug models train from random weights with ``indexer_training`` ``sparse``: each query
attends to its 64 best keys of 256, and the indexer learns the main attention's
distribution by its KL term (logged as ``indexer_kl``). Fine-tuning a released model keeps
the default ``off`` (the indexer as released; ``--model.hf_path`` names the folder).
"""

from __future__ import annotations

from temper.config import Config, Job, LRScheduler, Model, Optimizer, Training


def deepseek_v32_debug() -> Config:
    """A ~7.9M-parameter DeepSeek V3.2 (DeepSeek V3's debug model plus a 4-head indexer
    keeping 64 keys per query) on the built-in synthetic tasks, the indexer trained by its
    KL term; trains on a CPU."""
    return Config(
        job=Job(dump_folder="./outputs/deepseek_v32_debug"),
        model=Model(name="deepseek_v32", flavor="debug", indexer_training="sparse"),
        training=Training(steps=60, seq_len=256, local_batch_size=8, max_norm=1.0),
        optimizer=Optimizer(lr=2e-3, weight_decay=0.1),
        lr_scheduler=LRScheduler(warmup_steps=5, decay="cosine", min_lr_ratio=0.1),
    )


def glm_moe_dsa_debug() -> Config:
    """The same debug model as GLM-5 (its indexer's rotary in interleaved pairs)."""
    config = deepseek_v32_debug()
    config.job.dump_folder = "./outputs/glm_moe_dsa_debug"
    config.model.name = "glm_moe_dsa"
    return config
