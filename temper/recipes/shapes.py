"""The run shapes the family recipes share; each recipe names its model and what differs."""

from __future__ import annotations

from temper.config import (
    ActivationCheckpoint,
    Config,
    Data,
    Job,
    LRScheduler,
    Model,
    Optimizer,
    Parallelism,
    Training,
)


def debug_pretrain(model: Model) -> Config:
    """60 steps of 8 x 256 tokens of the built-in synthetic tasks at lr 2e-3 (a CPU trains a
    debug flavor in about a minute), written to ``./outputs/<name>_debug``."""
    return Config(
        job=Job(dump_folder=f"./outputs/{model.name}_debug"),
        model=model,
        training=Training(steps=60, seq_len=256, local_batch_size=8, max_norm=1.0),
        optimizer=Optimizer(lr=2e-3, weight_decay=0.1),
        lr_scheduler=LRScheduler(warmup_steps=5, decay="cosine", min_lr_ratio=0.1),
    )


def debug_sft(dump: str, model: Model, data: Data) -> Config:
    """Chat SFT of a random-init debug model on built-in tasks: 60 steps of 8 x 64 tokens at
    lr 2e-3 without weight decay (a CPU, minutes); written to ``./outputs/<dump>``."""
    return Config(
        job=Job(dump_folder=f"./outputs/{dump}"),
        model=model,
        training=Training(steps=60, seq_len=64, local_batch_size=8),
        optimizer=Optimizer(lr=2e-3, weight_decay=0.0),
        lr_scheduler=LRScheduler(warmup_steps=10, decay="cosine", min_lr_ratio=0.1),
        data=data,
    )


def _gpu_training(global_batch_size: int) -> Training:
    """1000 bf16 steps of 4096-token rows, one per rank per micro-batch."""
    return Training(
        steps=1000,
        seq_len=4096,
        local_batch_size=1,
        global_batch_size=global_batch_size,
        dtype="bfloat16",
        max_norm=1.0,
    )


def gpu_pretrain(dump: str, model: Model, global_batch_size: int) -> Config:
    """Pretraining a real size on GPUs (``_gpu_training``) at lr 1e-5, weight decay 0.1, 50
    warmup steps; written to ``./outputs/<dump>``."""
    return Config(
        job=Job(dump_folder=f"./outputs/{dump}"),
        model=model,
        training=_gpu_training(global_batch_size),
        optimizer=Optimizer(lr=1e-5, weight_decay=0.1),
        lr_scheduler=LRScheduler(warmup_steps=50, decay="cosine", min_lr_ratio=0.1),
    )


def gpu_sft(
    dump: str,
    model: Model,
    *,
    ep: int,
    global_batch_size: int,
    checkpoint: ActivationCheckpoint,
) -> Config:
    """Chat SFT of a released MoE on GPUs (``_gpu_training``, packed chat rows) with experts
    over ``ep`` ranks, at lr 1e-5, no weight decay, 30 warmup steps; written to
    ``./outputs/<dump>``."""
    return Config(
        job=Job(dump_folder=f"./outputs/{dump}"),
        model=model,
        parallelism=Parallelism(ep=ep),
        activation_checkpoint=checkpoint,
        training=_gpu_training(global_batch_size),
        optimizer=Optimizer(lr=1e-5, weight_decay=0.0),
        lr_scheduler=LRScheduler(warmup_steps=30, decay="cosine", min_lr_ratio=0.1),
        data=Data(format="sft"),
    )
