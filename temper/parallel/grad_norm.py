"""The global gradient norm and clipping, when gradients are sharded over several meshes."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from temper.utils.compat import foreach_mul_, foreach_norm


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale every gradient by one factor so the global norm is at most `max_norm`
    (`inf`: no clipping); return the global norm before clipping.

    Gradients are grouped by mesh and placements (plain tensors form one group). A group's
    sum of squares over local shards is partial along its sharded mesh dims and equal along
    replicated ones, so one reduction per group makes it whole; groups on different meshes
    (FSDP and expert weights) then add up, and clipping scales the local shards, which no
    DTensor op could do across meshes. Sums run in float64: in float32 the summation order
    alone moves the norm of even a small model by ~1e-6, more than layouts' gradients differ.
    """
    groups: dict[tuple | None, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            grad = p.grad
            key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
            groups.setdefault(key, []).append(grad)
    squares, shards = [], []
    for key, grads in groups.items():
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        square = torch.stack(foreach_norm(local, 2, dtype=torch.float64)).square().sum()
        if key is not None:
            mesh, placements = key
            # Not `is_shard()`: FSDP over an expert-parallel shard places `_StridedShard`,
            # which is no `Shard`.
            partial = [Replicate() if p.is_replicate() else Partial() for p in placements]
            square = DTensor.from_local(square, mesh, partial).full_tensor()
        squares.append(square)
        shards += local
    if not squares:
        return torch.zeros(())
    total = torch.stack(squares).sum().sqrt().float()
    if math.isfinite(max_norm):
        foreach_mul_(shards, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total
