"""Context parallelism (CP): each CP rank holds part of every sequence, and attention passes
keys and values around the ranks (``temper.kernels.ring_attention``) instead of splitting
heads as Ulysses does, so its degree is not capped by the model's key/value heads. DeepSeek
sparse attention, whose chosen keys lie anywhere before each query, all-gathers them instead
(``GatherCore``).

The layout is load-balanced: a sequence right-padded to a multiple of ``2 * cp`` is cut into
``2 * cp`` chunks and rank r holds chunks r and ``2cp - 1 - r`` (``load_balanced_indices``),
so under causal masking every rank has the same attention work. Positions stay global (RoPE
and the document mask read them); padding follows Ulysses' convention (label -100, position
``PAD_POSITION``: each pad its own document), and the padding is always the end of a rank's
local tokens, so ``SequenceShard.valid_len`` keeps it out of MoE routing statistics.

CP composes with Ulysses SP (2-D sequence parallelism): each CP rank's tokens are cut again
into ``sp`` contiguous slices, one per SP rank; around each mixer Ulysses' all-to-all gathers
the CP rank's tokens for a part of the heads, and the ring passes those heads' K/V blocks (or
Gated DeltaNet states) between the CP ranks holding the same part (``ContextParallel``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from temper.config import Config, ConfigError, register_rule
from temper.data.batch import (
    DOCUMENT_POSITIONS,
    IGNORE_INDEX,
    SEQUENCE_SHARD,
    Batch,
    SequenceShard,
    pad_tokens,
)
from temper.kernels.ring_attention import load_balanced_indices
from temper.models.layers.attention import Attention, GatedAttention
from temper.models.layers.context import ForwardContext, SequenceCore, SequenceMixer
from temper.models.layers.gated_deltanet import GatedDeltaNet, GroupedGatedDeltaNet
from temper.models.layers.mla import MLA
from temper.models.layers.sink_attention import SinkAttention
from temper.models.layers.sparse_attention import SparseMLA
from temper.models.layers.whole_sequence import local_part, whole_sequence
from temper.parallel.ulysses import (
    PAD_POSITION,
    PREFERENCE_SIDES,
    VISION_FIELDS,
    UlyssesCore,
    media_fields,
    sequence_mixers,
)

RING_MIXERS = (Attention, GatedAttention, MLA, SinkAttention, GatedDeltaNet, GroupedGatedDeltaNet)
"""The token mixers CP runs as a ring (``RingCore``): softmax attention through ``attend``,
which runs as ring attention, and Gated DeltaNet, whose state and convolution window pass from
rank to rank (``gated_deltanet.context_parallel_mix``)."""

GATHER_MIXERS = (SparseMLA,)
"""The token mixers CP runs on all-gathered keys and values (``GatherCore``): DeepSeek sparse
attention, whose queries each attend to keys chosen anywhere before them, which a ring's
blocks do not fit. A mixer of neither kind is refused, not run on part of each sequence
(DeepSeek V4's compressed attention is no sequence mixer: it gathers its inputs itself)."""


def shard_batch(
    batch: Batch,
    rank: int,
    size: int,
    group: dist.ProcessGroup | None = None,
    part: int = 0,
    parts: int = 1,
) -> Batch:
    """CP rank ``rank``'s tokens (of ``size``) of a [b, s] batch, right-padded to a multiple of
    ``2 * size * parts``, in the load-balanced layout; with ``parts`` > 1 (CP x SP) only the
    ``part``-th of ``parts`` contiguous slices of them (an SP rank's). ``group`` holds every
    rank with a share of the same rows. A preference batch (``chosen_*`` and ``rejected_*``
    fields) has each side sharded so.

    Every [b, s] field is taken at the rank's columns (``input_ids`` and others zero-padded,
    ``labels`` with -100, ``position_ids`` with ``PAD_POSITION``; rows without positions get
    0..s-1), [b] fields are kept whole. For packed rows ``DOCUMENT_POSITIONS`` holds the whole
    padded sequence's positions, from which the document mask of the whole sequence is built
    (ring attention reads it by global column); continuous rows need none (causal order by
    global column hides the trailing padding). ``SEQUENCE_SHARD`` holds the padded length, how
    many of the rank's tokens are real and every rank's columns in the group's order
    (``SequenceShard.columns``). A vision-language batch's images stay whole, as under Ulysses
    (``media_fields``): the model fuses them into the whole sequence and keeps the rank's
    columns; its multimodal positions are taken at the rank's columns.
    """
    if "input_ids" not in batch:
        return {
            side + key: value
            for side in PREFERENCE_SIDES
            for key, value in shard_batch(
                {k.removeprefix(side): v for k, v in batch.items() if k.startswith(side)},
                rank,
                size,
                group,
                part,
                parts,
            ).items()
        }
    input_ids, labels = batch["input_ids"], batch["labels"]
    b, s = input_ids.shape
    packed = batch.get("position_ids")
    positions = packed
    if positions is None:
        positions = torch.arange(s, device=input_ids.device).expand(b, s)
    pad = -s % (2 * size * parts)
    padded = {
        "input_ids": F.pad(input_ids, (0, pad), value=0),
        "labels": F.pad(labels, (0, pad), value=IGNORE_INDEX),
        "position_ids": F.pad(positions, (0, pad), value=PAD_POSITION),
    }
    for key, t in batch.items():
        if key not in padded and key not in VISION_FIELDS:
            padded[key] = pad_tokens(t, pad) if t.shape[:2] == (b, s) else t
    # Every rank's columns in the group's order (CP rank, then SP slice): ``SequenceShard``'s
    # ``columns``, by which the model joins the ranks' tokens into the whole sequence.
    every = torch.cat([load_balanced_indices(s + pad, r, size) for r in range(size)])
    every = every.to(input_ids.device)
    local = (s + pad) // (size * parts)
    start = (rank * parts + part) * local
    columns = every[start : start + local]
    # Padding is a suffix of the sequence and the rank's second chunk comes later than its
    # first, so the rank's real tokens come first in its local order (and in each slice).
    valid = int((columns < s).sum())
    shard = {key: t[:, columns] if t.shape[:2] == (b, s + pad) else t for key, t in padded.items()}
    shard[DOCUMENT_POSITIONS] = padded["position_ids"] if packed is not None else positions[:0]
    shard[SEQUENCE_SHARD] = SequenceShard(
        s + pad, valid, group=group, start=start, real_len=s, columns=every
    )
    shard.update(media_fields(batch, padded["input_ids"], columns))
    return shard


def unshard(parts: list[torch.Tensor]) -> torch.Tensor:
    """The whole sequences [b, s, ...] from every CP rank's tokens [b, s / cp, ...] (by rank):
    the inverse of the layout."""
    size = len(parts)
    whole = torch.cat(parts, dim=1)
    order = torch.cat(
        [load_balanced_indices(whole.shape[1], r, size, whole.device) for r in range(size)]
    )
    return whole[:, order.argsort()]


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every CP rank's ``x`` [b, s / cp, ...] gathered into whole sequences, in global order
    (not differentiable: for outputs read after the step, such as logits under test)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return unshard(parts)


def _refuse_cache(ctx: ForwardContext) -> None:
    if ctx.cache is not None:
        raise ValueError(
            "parallelism.cp: a KV cache decodes whole rows; generate inside "
            "temper.parallel.ulysses.whole_sequences (as RL rollouts do)"
        )


class RingCore:
    """A ``SequenceCore`` for CP: the mixer's own ``mix_heads`` with ``ctx.context_group`` set,
    so its attention (``temper.models.layers.attention.attend``) runs as ring attention over
    the group with the mixer's scale, window and sinks, and Gated DeltaNet passes its state
    along the chunks."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(
        self,
        mixer: SequenceMixer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext,
        *heads: torch.Tensor,
    ) -> torch.Tensor:
        _refuse_cache(ctx)
        return mixer.mix_heads(q, k, v, dataclasses.replace(ctx, context_group=self.group), *heads)


class GatherCore:
    """A ``SequenceCore`` for CP by all-gather (as in the Llama 3 paper): every rank of the
    group gathers the whole sequence's keys and values, in sequence order, and attends with
    its own queries; autograd through the gather sends each rank its tokens' dK and dV back.
    For mixers whose attention reads its mask from ``ctx.selected`` (sparse attention's
    chosen keys, [b, seq_len, seq_len] over the whole sequence): the core keeps the mask's
    rows of this rank's queries. Each rank holds the layer's whole K/V, so the memory of
    attention's inputs does not shrink with the CP degree as the ring's does.

    Under CP x SP it runs inside Ulysses' all-to-alls: its tokens are then the CP rank's (its
    SP slices joined) for a part of the heads, and the group links the CP ranks holding that
    part, as for the ring."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def __call__(
        self,
        mixer: SequenceMixer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext,
        *heads: torch.Tensor,
    ) -> torch.Tensor:
        _refuse_cache(ctx)
        assert ctx.shard is not None and ctx.selected is not None  # CP shards; the mixer chose
        # The CP rank's tokens among the group's, joined in CP rank order: under CP x SP they
        # are its SP slices, which the columns list first in (cp, sp) order.
        shard = dataclasses.replace(
            ctx.shard, group=self.group, start=self.rank * ctx.shard.seq_len // self.size
        )
        k, v = whole_sequence(k, shard), whole_sequence(v, shard)
        ctx = dataclasses.replace(ctx, selected=local_part(ctx.selected, shard))
        return mixer.mix_heads(q, k, v, ctx, *heads)


class ContextParallel:
    """One CP group, alone or composed with an SP group (2-D sequence parallelism): shards
    batches for its ranks (``shard``) and wires a decoder for them (``apply``).

    ``sp`` is this rank's SP group (None: CP alone) and ``rows`` the group of every CP x SP
    rank sharing the same rows (objectives reduce whole-sequence sums over it); the CP
    ``group`` then links the ranks holding the same SP slice, that is the same heads after
    Ulysses' all-to-all."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        sp: dist.ProcessGroup | None = None,
        rows: dist.ProcessGroup | None = None,
    ) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.sp = sp
        self.sp_size = 1 if sp is None else dist.get_world_size(sp)
        self.sp_rank = 0 if sp is None else dist.get_rank(sp)
        if sp is not None and rows is None:
            raise ValueError("ContextParallel with an SP group needs the CP x SP group (rows)")
        self.rows = group if sp is None else rows
        # The shard's columns list the ranks' tokens in the rows group's order, taken to be
        # (cp, sp) row-major, as the flattened cp_sp mesh is.
        if dist.get_rank(self.rows) != self.rank * self.sp_size + self.sp_rank:
            raise ValueError(
                f"ContextParallel: rank {dist.get_rank(self.rows)} of the CP x SP group is CP "
                f"rank {self.rank} and SP rank {self.sp_rank}; the group must be in (cp, sp) "
                "row-major order"
            )

    def shard(self, batch: Batch) -> Batch:
        """This rank's tokens of ``batch`` (see ``shard_batch``)."""
        return shard_batch(batch, self.rank, self.size, self.rows, self.sp_rank, self.sp_size)

    def apply(self, model: nn.Module) -> None:
        """Route every token mixer's sequence core through its CP form (``RingCore``, or
        ``GatherCore`` for sparse attention), inside Ulysses' all-to-alls (``UlyssesCore``)
        under CP x SP. Runs on the meta model, before any other wrapper; a mixer of another
        kind is refused."""
        ring: SequenceCore = RingCore(self.group)
        gather: SequenceCore = GatherCore(self.group)
        if self.sp is not None:
            ring, gather = UlyssesCore(self.sp, inner=ring), UlyssesCore(self.sp, inner=gather)
        for mixer in sequence_mixers(model):
            if type(mixer) in RING_MIXERS:
                mixer.sequence_core = ring
            elif type(mixer) in GATHER_MIXERS:
                mixer.sequence_core = gather
            else:
                raise ConfigError(
                    f"parallelism.cp: {type(mixer).__name__} layers have no context-parallel "
                    "form yet (it covers softmax attention, MLA, DeepSeek sparse attention and "
                    "Gated DeltaNet); use parallelism.sp"
                )


@register_rule
def check_context_parallel(config: Config, world_size: int) -> None:
    """What CP does not cover yet is refused by name before any work (the model's own layers
    are checked by its family's layout rule and again by ``ContextParallel.apply``)."""
    p = config.parallelism
    if p.cp == 1:
        return
    refusals = {
        "objective.name": (
            config.objective.name not in ("causal_lm", "dpo", "grpo"),
            f"only causal_lm, dpo and grpo train under CP so far, not {config.objective.name!r}",
        ),
        "optimizer.muon_qk_clip": (
            config.optimizer.muon_qk_clip > 0,
            "QK-clip's logit maximum needs whole sequences",
        ),
    }
    for field, (refused, why) in refusals.items():
        if refused:
            raise ConfigError(f"parallelism.cp = {p.cp} with {field}: {why}")
