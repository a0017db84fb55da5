"""Optimizer construction from the config."""

from __future__ import annotations

import torch
from torch import nn

from temper.config import Optimizer as OptimizerConfig


def build_optimizer(model: nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only: decaying norm gains and biases hurts. On CUDA
    the fused kernel updates every parameter in one launch; elsewhere torch's default."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        fused=True if params and params[0].device.type == "cuda" else None,
    )
