"""Reductions over all ranks of values the loop needs whole: token counts, the step's loss,
rollout metrics."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum over all ranks (identity in a single process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def combine_metrics(
    parts: Sequence[Mapping[str, torch.Tensor | float]], device: torch.device
) -> dict[str, torch.Tensor]:
    """One value per name over every part on every rank: the mean, or the maximum for names
    ending in ``_max``. Every rank must pass parts with the same names. The results stay on
    ``device`` (no host sync)."""
    names = sorted(parts[0])
    values = torch.stack(
        [
            torch.stack([torch.as_tensor(p[n], dtype=torch.float32, device=device) for n in names])
            for p in parts
        ]
    )
    peak, total = values.max(dim=0).values, values.sum(dim=0)
    count = len(parts)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        count *= dist.get_world_size()
    return {n: peak[i] if n.endswith("_max") else total[i] / count for i, n in enumerate(names)}


def all_gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), by rank; ``[value]`` in a single process."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def sum_over_data_ranks(
    counts: Mapping[str, int], copies: int, device: torch.device
) -> dict[str, int]:
    """Counts summed over the data-parallel ranks, when each data rank's counts are held by
    ``copies`` ranks alike (its sequence-parallel peers): world sum / copies. Exact integers:
    the sum is taken in float64."""
    names = sorted(counts)
    values = torch.tensor([float(counts[n]) for n in names], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return {n: round(float(v) / copies) for n, v in zip(names, values, strict=True)}
