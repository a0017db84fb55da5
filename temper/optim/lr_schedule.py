"""Learning-rate schedule: linear warmup, then linear, cosine or warmup-stable-decay."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from temper.config import LRScheduler


def lr_factor(step: int, total_steps: int, config: LRScheduler) -> float:
    """Multiplier of the peak lr for 0-based optimizer step `step`.

    Warmup reaches the peak at its last step; every decay ends exactly at
    `min_lr_ratio` on the last training step.
    """
    warmup, floor = config.warmup_steps, config.min_lr_ratio
    if step < warmup:
        return (step + 1) / warmup
    if config.decay == "wsd":
        decay_steps = max(1, min(math.ceil(config.decay_ratio * total_steps), total_steps - warmup))
        progress = max(0, step - (total_steps - decay_steps) + 1) / decay_steps
        return 1.0 - (1.0 - floor) * min(progress, 1.0)
    progress = min(1.0, (step - warmup + 1) / max(1, total_steps - warmup))
    if config.decay == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, config: LRScheduler, total_steps: int
) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, config))
