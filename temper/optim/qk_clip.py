"""QK-clip (MuonClip, Kimi K2): keep attention logits from growing without bound.

Muon's updates have a fixed RMS whatever the gradient, and in large runs a few heads' query
and key weights grow until their logits blow up. After each optimizer step, every head whose
largest logit in that step's forwards exceeded the threshold ``tau`` has its query rows
scaled by ``tau / max``: the same inputs would then give that head a largest logit of
exactly ``tau``. (Kimi K2 splits the factor as a square root over query and key; with
grouped-query attention several query heads share a key head, so the whole factor goes on
the query, which gives each head exactly its own.) Heads under the threshold are untouched.

The maxima come from every rank's forwards (one all-reduce of all layers' maxima), so every
rank scales its shard of the query weights alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from temper.config import ConfigError
from temper.models.layers.attention import Attention, LogitMax
from temper.optim.sharded_matrices import row_shard_dim, rows_of


class QKClip:
    """Tracks the largest logit of each head of ``model``'s attention layers; `apply` clips."""

    def __init__(self, model: nn.Module, threshold: float) -> None:
        self.threshold = threshold
        self.layers = clippable_attention(model)
        for layer in self.layers:
            layer.logit_max = LogitMax()
        self.clipped = 0  # heads clipped by the latest `apply`

    def pause(self, paused: bool) -> None:
        """Ignore forwards (rollouts while the optimizer is offloaded) until unpaused."""
        for layer in self.layers:
            layer.logit_max.paused = paused

    @torch.no_grad()
    def apply(self) -> None:
        """Scale the query rows of each head over the threshold; start the next step's maxima."""
        maxima = [layer.logit_max.take() for layer in self.layers]
        if any(m is None for m in maxima):  # no forward since the last step
            self.clipped = 0
            return
        stacked = torch.stack(maxima)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
        factors = (self.threshold / stacked).clamp(max=1.0)
        self.clipped = int((factors < 1.0).sum())
        for layer, factor in zip(self.layers, factors, strict=True):
            per_row = factor.repeat_interleave(layer.head_dim)
            for param in layer.wq.parameters():
                _scale_rows(param, per_row)


def clippable_attention(model: nn.Module) -> list[Attention]:
    """``model``'s attention layers, or a ConfigError saying why QK-clip cannot serve it
    (works on the meta model, before any weight exists)."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        raise ConfigError(
            "optimizer.muon_qk_clip needs grouped-query attention layers (wq, wk); this "
            "model has none (multi-head latent attention is not supported)"
        )
    if any(not isinstance(m.q_norm, nn.Identity) for m in layers):
        raise ConfigError(
            "optimizer.muon_qk_clip: this model normalizes q and k per head (q_norm, "
            "k_norm), which bounds the logits already and would undo a scaled wq"
        )
    return layers


def _scale_rows(param: torch.Tensor, per_row: torch.Tensor) -> None:
    """Multiply each global row ``i`` of ``param`` (a weight or bias) by ``per_row[i]``, on
    this rank's rows only when it is row-sharded."""
    local = param.to_local() if isinstance(param, DTensor) else param
    dim = row_shard_dim(param) if param.ndim == 2 else _vector_shard_dim(param)
    if dim is not None:
        mesh = param.device_mesh
        start, size = rows_of(param.shape[0], mesh.size(dim), mesh.get_coordinate()[dim])
        per_row = per_row[start : start + size]
    scale = per_row.to(local.dtype)
    local.mul_(scale[:, None] if local.ndim == 2 else scale)


def _vector_shard_dim(param: torch.Tensor) -> int | None:
    """The mesh dim splitting a 1-D DTensor (a bias under FSDP), or None."""
    if not isinstance(param, DTensor) or param.to_local().shape == param.shape:
        return None
    return next(i for i, p in enumerate(param.placements) if p.is_shard(0))
