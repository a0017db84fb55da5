"""Sums over all ranks of values the loop needs whole: token counts, the step's loss."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum over all ranks (identity in a single process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value
