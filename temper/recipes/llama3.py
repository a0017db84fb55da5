"""Llama 3 recipes: plain functions returning a Config; derive by calling and editing."""

from __future__ import annotations

from temper.config import Config, Job, LRScheduler, Model, Optimizer, Training


def llama3_debug() -> Config:
    """A ~4M-parameter Llama 3 on the built-in synthetic tasks; trains on a CPU in a minute."""
    return Config(
        job=Job(dump_folder="./outputs/llama3_debug"),
        model=Model(name="llama3", flavor="debug"),
        training=Training(steps=60, seq_len=256, local_batch_size=8, max_norm=1.0),
        optimizer=Optimizer(lr=2e-3, weight_decay=0.1),
        lr_scheduler=LRScheduler(warmup_steps=5, decay="cosine", min_lr_ratio=0.1),
    )
