"""Plain data parallelism: every rank holds the whole model and sums its gradients."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum over all ranks (identity in a single process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def all_reduce_gradients(model: nn.Module) -> None:
    """Sum gradients over ranks in one flat buffer.

    The loss is already divided by the global token count, so the sum (not the
    mean) is the gradient of the global batch.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
