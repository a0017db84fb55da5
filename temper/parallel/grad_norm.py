"""The global gradient norm and clipping, when gradients are sharded over several meshes."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from temper.utils.compat import foreach_mul_, foreach_norm


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale every gradient by one factor so the global norm is at most `max_norm`
    (`inf`: no clipping); return the global norm before clipping.

    Gradients are grouped by mesh and placements (plain tensors form one group). A group's
    sum of squares over local shards is partial along its sharded mesh dims and equal along
    replicated ones, so one reduction per group makes it whole (``_sum_over_shards``);
    groups on different meshes (FSDP and expert weights) then add up, and clipping scales
    the local shards, which no DTensor op could do across meshes. Sums run in float64: in
    float32 the summation order alone moves the norm of even a small model by ~1e-6, more
    than layouts' gradients differ.
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
            square = _sum_over_shards(square, *key)
        squares.append(square)
        shards += local
    if not squares:
        return torch.zeros(())
    total = torch.stack(squares).sum().sqrt().float()
    if math.isfinite(max_norm):
        foreach_mul_(shards, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def _sum_over_shards(square: torch.Tensor, mesh: DeviceMesh, placements: tuple) -> torch.Tensor:
    """A sum of squares over local shards made whole: summed over the ranks that hold other
    shards, not over those that hold copies. Every Temper mesh spans the world, so one
    all-reduce over it and a division by the number of copies (replicated mesh dims) does it;
    DTensor's redistribute would run one all-reduce per sharded dim."""
    if not dist.is_initialized() or mesh.size() != dist.get_world_size():
        raise ValueError(f"gradient norm over a mesh that is not the whole world: {mesh}")
    # Copies, not `not is_shard()`: FSDP over an expert-parallel shard places `_StridedShard`.
    copies = math.prod(mesh.size(d) for d, p in enumerate(placements) if p.is_replicate())
    square = square.clone()
    dist.all_reduce(square)
    return square / copies
