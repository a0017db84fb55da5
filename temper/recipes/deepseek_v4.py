"""DeepSeek V4 recipes: plain functions returning a Config; derive by calling and editing.

The family trains whole rows (packed or not) under FSDP and expert parallelism and decodes
with the growing KV cache; sequence and context parallelism are not built yet
(docs/models.md).
"""

from __future__ import annotations

from temper.config import Config, Job, LRScheduler, Model, Optimizer, Training


def deepseek_v4_debug() -> Config:
    """The debug model (one sliding, two CSA and one HCA layer, a hash-routed then top-k MoE
    layers, 4 residual streams) on the built-in synthetic tasks; trains on a CPU. At 256
    tokens, CSA keeps 8 of up to 64 compressed entries per query and HCA reads up to 16."""
    return Config(
        job=Job(dump_folder="./outputs/deepseek_v4_debug"),
        model=Model(name="deepseek_v4", flavor="debug"),
        training=Training(steps=60, seq_len=256, local_batch_size=8, max_norm=1.0),
        optimizer=Optimizer(lr=2e-3, weight_decay=0.1),
        lr_scheduler=LRScheduler(warmup_steps=5, decay="cosine", min_lr_ratio=0.1),
    )
