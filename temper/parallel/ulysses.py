"""Ulysses sequence parallelism: each SP rank holds a slice of the sequence, attention (and
Gated DeltaNet's convolution and recurrence) a slice of the heads.

The batch is right-padded to a multiple of SP and sliced along the sequence before the model
call (``SequenceParallel.shard``, the model entry). Around each attention core an all-to-all
turns q, k, v from sequence-sharded [b, s/sp, h, d] into head-sharded [b, s, h/sp, d], so
attention sees the whole sequence (and the global ``DocumentMask``), and the reverse
all-to-all brings the output back. Everything else in a block works token by token.

Padding keeps out of the results: pad tokens carry label -100 (no loss, no token count) and
position ``PAD_POSITION``, which makes each pad its own one-token document in the global mask,
so no real token attends to one; MoE routing statistics are taken over real tokens only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from temper.config import ConfigError
from temper.kernels.attention import Backend, DocumentMask
from temper.kernels.attention import attention as causal_attention
from temper.models.layers.gated_deltanet import GatedDeltaNet, gated_delta_mix
from temper.models.layers.moe import MoE, RoutingStats, tokens_per_expert
from temper.objectives.causal_lm import DOCUMENT_POSITIONS, IGNORE_INDEX, Batch

PAD_POSITION = -1
"""Position of a padding token: never its predecessor's + 1, so each pad is its own document."""


def check_heads(n_heads: int, n_kv_heads: int, sp: int) -> None:
    """Heads must split evenly over SP ranks; KV heads fewer than SP are replicated, so SP must
    then be a multiple of them (each rank gets one copy of one KV head)."""
    if n_heads % sp:
        raise ConfigError(
            f"parallelism.sp ({sp}) must divide the model's attention heads ({n_heads}): "
            "Ulysses gives each SP rank the same number of heads"
        )
    if n_kv_heads % sp and sp % n_kv_heads:
        raise ConfigError(
            f"parallelism.sp ({sp}) and the model's KV heads ({n_kv_heads}) must divide one "
            "another: KV heads are split over SP ranks, or replicated when fewer than SP"
        )


def shard_batch(batch: Batch, rank: int, size: int) -> Batch:
    """SP rank ``rank``'s slice (of ``size``) of a [b, s] batch, right-padded to a multiple of
    ``size``.

    ``input_ids``, ``labels`` and ``position_ids`` are sliced; for packed rows the padded
    global positions go to ``DOCUMENT_POSITIONS``, from which the objective builds the
    document mask that attention (which sees the whole sequence) needs. Without
    ``position_ids`` the rows are continuous sequences at positions 0..s-1: they need no mask
    (the padding comes last, and causal order hides it), so ``DOCUMENT_POSITIONS`` is empty,
    and attention keeps its mask-free causal kernel, which never holds the [s, s] scores.
    """
    input_ids, labels = batch["input_ids"], batch["labels"]
    b, s = input_ids.shape
    packed = batch.get("position_ids")
    positions = packed
    if positions is None:
        positions = torch.arange(s, device=input_ids.device).expand(b, s)
    pad = -s % size
    padded = {
        "input_ids": F.pad(input_ids, (0, pad), value=0),
        "labels": F.pad(labels, (0, pad), value=IGNORE_INDEX),
        "position_ids": F.pad(positions, (0, pad), value=PAD_POSITION),
    }
    local = (s + pad) // size
    shard = {key: t[:, rank * local : (rank + 1) * local] for key, t in padded.items()}
    shard[DOCUMENT_POSITIONS] = padded["position_ids"] if packed is not None else positions[:0]
    return shard


class UlyssesAttention:
    """The attention core between two all-to-alls over the SP ``group``; a drop-in for
    ``temper.kernels.attention.attention`` on sequence-sharded q, k, v."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        docs: DocumentMask | None = None,
        *,
        backend: Backend = "auto",
        scale: float | None = None,
    ) -> torch.Tensor:
        if k.shape[2] < self.size:
            k, v = (t.repeat_interleave(self.size // k.shape[2], dim=2) for t in (k, v))
        q, k, v = (self._heads_to_ranks(t) for t in (q, k, v))
        out = causal_attention(q, k, v, docs, backend=backend, scale=scale)
        return self._sequence_to_ranks(out)

    def _heads_to_ranks(self, x: torch.Tensor) -> torch.Tensor:
        return heads_to_ranks(x, self.group, self.size)

    def _sequence_to_ranks(self, x: torch.Tensor) -> torch.Tensor:
        return sequence_to_ranks(x, self.group, self.size)


def heads_to_ranks(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """[b, s/sp, h, d] -> [b, s, h/sp, d]: send head slice r to rank r, gather sequence."""
    b, s, h, d = x.shape
    x = x.reshape(b, s, size, h // size, d).permute(2, 0, 1, 3, 4).contiguous()
    x = all_to_all_single_autograd(x, None, None, group)
    return x.permute(1, 0, 2, 3, 4).reshape(b, size * s, h // size, d)


def sequence_to_ranks(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """[b, s, h/sp, d] -> [b, s/sp, h, d]: the reverse of ``heads_to_ranks``."""
    b, s, h, d = x.shape
    x = x.reshape(b, size, s // size, h, d).transpose(0, 1).contiguous()
    x = all_to_all_single_autograd(x, None, None, group)
    return x.permute(1, 2, 0, 3, 4).reshape(b, s // size, size * h, d)


def check_linear_attention_heads(n_k_heads: int, n_v_heads: int, sp: int) -> None:
    """Each SP rank runs whole Gated DeltaNet heads: a slice of the key heads and the value
    heads they serve, so SP must divide both counts (no replication: a key head's state is
    per value head)."""
    if n_k_heads % sp or n_v_heads % sp:
        raise ConfigError(
            f"parallelism.sp ({sp}) must divide the model's Gated DeltaNet key heads "
            f"({n_k_heads}) and value heads ({n_v_heads}): Ulysses gives each SP rank whole "
            "heads for the convolution and the recurrence"
        )


class UlyssesGatedDeltaNet:
    """Gated DeltaNet's cross-token core (``gated_delta_mix``) between all-to-alls over the SP
    ``group``: each rank convolves and recurs over the whole sequence for its part of the
    heads (with their convolution channels, A_log and dt_bias), so neither step needs a halo
    exchange; the projections and the gated norm around it stay token-local."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def __call__(
        self,
        layer: GatedDeltaNet,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        docs: DocumentMask | None = None,
        cache: None = None,
    ) -> torch.Tensor:
        if cache is not None:
            raise ValueError("sequence parallelism is for training; decode without it")
        q, k, v = (heads_to_ranks(t, self.group, self.size) for t in (q, k, v))
        b, a = (heads_to_ranks(t[..., None], self.group, self.size)[..., 0] for t in (b, a))
        out = gated_delta_mix(layer, q, k, v, b, a, docs, part=self.rank, parts=self.size)
        return sequence_to_ranks(out, self.group, self.size)


class SequenceParallel:
    """One SP group: slices batches (``shard``) and wires a decoder for them (``apply``)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._valid: torch.Tensor | None = None

    def shard(self, batch: Batch) -> Batch:
        """This rank's slice of ``batch`` (see ``shard_batch``)."""
        return shard_batch(batch, self.rank, self.size)

    def apply(self, model: nn.Module) -> None:
        """Route every attention core through the all-to-alls and keep padding out of MoE
        routing statistics. Runs on the meta model, before any other wrapper."""
        args = model.args
        check_heads(args.n_heads, getattr(args, "n_kv_heads", args.n_heads), self.size)
        attend = UlyssesAttention(self.group)
        mix = UlyssesGatedDeltaNet(self.group)
        for block in model.layers:
            mixer = block.attention
            if isinstance(mixer, GatedDeltaNet):
                check_linear_attention_heads(mixer.n_k_heads, mixer.n_v_heads, self.size)
                mixer.mix = mix
            else:
                mixer.attend = attend
        # Noted around the body that forward and hidden_states (the fused loss) both run.
        body = model._hidden_states

        def noting_valid(*args: Any, **kwargs: Any) -> torch.Tensor:
            self._note_valid(args, kwargs)
            return body(*args, **kwargs)

        model._hidden_states = noting_valid
        for moe in (m for m in model.modules() if isinstance(m, MoE)):
            routed: dict[str, torch.Tensor] = {}
            moe.router.register_forward_hook(lambda _m, _a, out, r=routed: r.update(out=out))
            moe.register_forward_hook(
                lambda m, _a, _o, r=routed: setattr(m, "routing", self._routing(m, *r["out"]))
            )

    def _note_valid(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Remember which of this call's tokens are real (not padding), for the MoE hooks."""
        positions = args[1] if len(args) > 1 else kwargs.get("position_ids")
        self._valid = None if positions is None else (positions != PAD_POSITION).flatten()

    def _routing(
        self, moe: MoE, probs: torch.Tensor, _weights: torch.Tensor, experts: torch.Tensor
    ) -> RoutingStats:
        """The layer's statistics over this rank's real tokens; the load-balancing loss sums
        them over ranks, so they add up to those of the whole unpadded sequence."""
        valid = self._valid
        if valid is None:
            return moe.routing
        counts = tokens_per_expert(experts[valid], moe.n_experts)
        return RoutingStats(counts, probs[valid].sum(dim=0), int(valid.sum()))
