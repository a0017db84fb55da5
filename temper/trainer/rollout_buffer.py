"""The current RL rollout as checkpoint state, so a run resumed between two updates of one
rollout trains on the rollout it had, not on a new one drawn from extra prompts.

Each rank holds its own rollout rows, of widths that differ between ranks and rollouts, and a
DCP load fills tensors whose shapes are known beforehand. So every per-token field
([rows, w, ...]) is stored padded to a fixed width (``training.seq_len``) beside its real
width, and each tensor becomes one rank's row of a [world, ...] tensor sharded by rank (a
DTensor over all ranks): each rank writes and reads back its own. The rollout's metrics are
the same on every rank (reduced over all of them) and go to the checkpoint's JSON as floats,
which round-trip exactly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from temper.data.batch import Batch, pad_tokens

Rollout = tuple[list[Batch], dict[str, torch.Tensor]]
"""A step's rollout micro-batches and their metrics, as the Trainer keeps them."""


def rollout_state(
    micro_batches: list[Batch], metrics: dict[str, torch.Tensor] | None, width: int
) -> dict[str, Any]:
    """``micro_batches`` (fields [rows] or [rows, w, ...] with w <= ``width``) and ``metrics`` as a
    checkpoint's nested state. Metrics None: a template to load into."""
    state: dict[str, Any] = {"micro_batches": [_padded(batch, width) for batch in micro_batches]}
    if metrics is not None:
        state["metrics"] = {name: float(value) for name, value in metrics.items()}
    return state


def restore_rollout(state: dict[str, Any]) -> Rollout:
    """The rollout ``rollout_state`` saved: each field back at its real width, the metrics
    on the fields' device."""
    micro_batches = []
    for saved in state["micro_batches"]:
        local = {key: _own_row(value) for key, value in saved.items()}
        width = int(local.pop("width"))
        micro_batches.append({k: v[:, :width] if v.dim() >= 2 else v for k, v in local.items()})
    device = micro_batches[0]["input_ids"].device
    metrics = {
        name: torch.tensor(value, dtype=torch.float32, device=device)
        for name, value in state["metrics"].items()
    }
    return micro_batches, metrics


def _padded(batch: Batch, width: int) -> dict[str, torch.Tensor]:
    widths = {v.shape[1] for v in batch.values() if v.dim() >= 2}
    if len(widths) != 1 or max(widths) > width:
        raise ValueError(f"rollout fields of widths {sorted(widths)} do not fit width {width}")
    (own,) = widths
    device = next(iter(batch.values())).device
    fields = {k: pad_tokens(v, width - own) if v.dim() >= 2 else v for k, v in batch.items()}
    fields["width"] = torch.tensor(own, device=device)
    return {key: _rank_sharded(value) for key, value in fields.items()}


def _rank_sharded(local: torch.Tensor) -> torch.Tensor:
    """``local`` as this rank's row of a [world, ...] tensor sharded by rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local.unsqueeze(0)
    # A one-dimensional mesh over every rank reuses the default process group.
    mesh = init_device_mesh(local.device.type, (dist.get_world_size(),))
    return DTensor.from_local(local.unsqueeze(0), mesh, [Shard(0)], run_check=False)


def _own_row(value: torch.Tensor) -> torch.Tensor:
    local = value.to_local() if isinstance(value, DTensor) else value
    return local[0]
