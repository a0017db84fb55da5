"""Ulysses sequence parallelism: each SP rank holds a slice of the sequence, attention (and
Gated DeltaNet's convolution and recurrence) a slice of the heads.

The batch is right-padded to a multiple of SP and sliced along the sequence before the model
call (``SequenceParallel.shard``, the model entry); the slice travels with a
``SequenceShard`` that the objective hands the decoder. Around each token mixer's sequence
core (``temper.models.layers.context``: attention's, Gated DeltaNet's) an all-to-all turns
q, k, v from sequence-sharded [b, s/sp, h, d] into head-sharded [b, s, h/sp, d], so the
mixer sees the whole sequence (and masks built at its length), and the reverse all-to-all
brings the output back. Everything else in a block works token by token.

Padding keeps out of the results: pad tokens carry label -100 (no loss, no token count) and
position ``PAD_POSITION``, which makes each pad its own one-token document in the global mask,
so no real token attends to one; the ``SequenceShard``'s ``valid_len`` keeps them out of MoE
routing statistics.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from temper.data.batch import (
    DOCUMENT_POSITIONS,
    FUSION_INPUT_IDS,
    IGNORE_INDEX,
    SEQUENCE_SHARD,
    Batch,
    SequenceShard,
    pad_tokens,
)
from temper.models.layers.context import (
    ForwardContext,
    SequenceCore,
    SequenceMixer,
    local_core,
)
from temper.utils.compat import all_to_all_single_autograd

PAD_POSITION = -1
"""Position of a padding token: never its predecessor's + 1, so each pad is its own document."""

PREFERENCE_SIDES = ("chosen_", "rejected_")
"""The field prefixes of a DPO batch's two sequences."""

VISION_FIELDS = ("rope_position_ids", "pixel_values", "image_grid_thw")
"""A vision-language batch's fields that are not [b, s] token fields; see ``shard_batch``."""


def shard_batch(
    batch: Batch, rank: int, size: int, group: dist.ProcessGroup | None = None
) -> Batch:
    """SP rank ``rank``'s slice (of ``size``, the SP ``group``) of a [b, s] batch, right-padded
    to a multiple of ``size``. A preference batch (``chosen_*`` and ``rejected_*`` fields) has
    each side sliced so.

    ``input_ids``, ``labels``, ``position_ids`` and any other [b, s] field (zero-padded) are
    sliced, [b] fields are kept whole, and ``SEQUENCE_SHARD`` holds
    the slice's ``SequenceShard`` (the padded length; how many of its tokens are real) for
    the decoder. A vision-language batch's images stay whole (every SP rank runs the tower on
    all of them) with the whole sequence's ids (``FUSION_INPUT_IDS``): the model fuses the
    image features into the whole sequence and keeps its slice, so the slice is taken after
    fusion; its multimodal positions are sliced like the tokens.
    For packed rows the padded global positions go to ``DOCUMENT_POSITIONS``,
    from which the objective builds the document mask that attention (which sees the whole
    sequence) needs. Without ``position_ids`` the rows are continuous sequences at positions
    0..s-1: they need no mask (the padding comes last, and causal order hides it), so
    ``DOCUMENT_POSITIONS`` is empty, and attention keeps its mask-free causal kernel, which
    never holds the [s, s] scores (a backend that needs a mask builds it at the padded length).
    """
    if "input_ids" not in batch:
        return {
            side + key: value
            for side in PREFERENCE_SIDES
            for key, value in shard_batch(_side(batch, side), rank, size, group).items()
        }
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
    # Other per-token fields (a rollout's old log-probabilities) are sliced with the tokens;
    # per-row ones ([b]: advantages) go to every slice.
    for key, t in batch.items():
        if key not in padded and key not in VISION_FIELDS:
            padded[key] = pad_tokens(t, pad) if t.shape[:2] == (b, s) else t
    local = (s + pad) // size
    start = rank * local
    shard = {
        key: t[:, start : start + local] if t.shape[:2] == (b, s + pad) else t
        for key, t in padded.items()
    }
    shard[DOCUMENT_POSITIONS] = padded["position_ids"] if packed is not None else positions[:0]
    shard[SEQUENCE_SHARD] = SequenceShard(
        s + pad, min(max(s - start, 0), local), group=group, start=start, real_len=s
    )
    shard.update(media_fields(batch, padded["input_ids"], slice(start, start + local)))
    return shard


def media_fields(batch: Batch, padded_ids: torch.Tensor, columns: slice | torch.Tensor) -> Batch:
    """A vision-language batch's fields for one rank's tokens at ``columns`` of the padded
    sequence (``padded_ids`` [b, s + pad]); none for text. The images and grids stay whole
    (every rank runs the tower on all of them), ``FUSION_INPUT_IDS`` is the whole padded ids
    (the model fuses the images into the whole sequence, then keeps the rank's tokens:
    ``temper.models.layers.whole_sequence.local_part``), and the multimodal positions
    [3, b, s] are taken at the rank's columns like the tokens."""
    fields: Batch = {}
    if "rope_position_ids" in batch:
        pad = padded_ids.shape[1] - batch["rope_position_ids"].shape[-1]
        fields["rope_position_ids"] = F.pad(batch["rope_position_ids"], (0, pad))[..., columns]
    if "pixel_values" in batch:
        fields["pixel_values"] = batch["pixel_values"]
        fields["image_grid_thw"] = batch["image_grid_thw"]
        fields[FUSION_INPUT_IDS] = padded_ids
    return fields


def _side(batch: Batch, side: str) -> Batch:
    return {key.removeprefix(side): v for key, v in batch.items() if key.startswith(side)}


class UlyssesCore:
    """A ``SequenceCore`` between two all-to-alls over the SP ``group``: q, k, v and the
    mixer's other per-head inputs go from sequence-sharded [b, s/sp, h, ...] to head-sharded
    [b, s, h/sp, ...], the mixer's ``mix_heads`` runs on whole sequences of this rank's part
    of the heads (``ForwardContext.head_part``, which its per-head weights follow), and the
    reverse all-to-all brings the output back. An input with fewer heads than ranks (GQA's
    keys and values) is repeated first, so each rank gets one copy of one head.

    ``inner`` runs ``mix_heads`` on the gathered tokens: ``local_core`` when they are whole
    sequences, context parallelism's ring (``RingCore``) when they are one CP rank's part.

    A KV cache means whole rows are being decoded (the decoder refuses slices with one): the
    mixer then runs on this rank alone."""

    def __init__(self, group: dist.ProcessGroup, inner: SequenceCore = local_core) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.inner = inner

    def __call__(
        self,
        mixer: SequenceMixer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext,
        *heads: torch.Tensor,
    ) -> torch.Tensor:
        if ctx.cache is not None:
            return mixer.mix_heads(q, k, v, ctx, *heads)
        q, k, v, *heads = (self._heads_to_ranks(t) for t in (q, k, v, *heads))
        ctx = dataclasses.replace(ctx, head_part=self.rank, head_parts=self.size)
        out = self.inner(mixer, q, k, v, ctx, *heads)
        return sequence_to_ranks(out, self.group, self.size)

    def _heads_to_ranks(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[2] < self.size:
            x = x.repeat_interleave(self.size // x.shape[2], dim=2)
        return heads_to_ranks(x, self.group, self.size)


def heads_to_ranks(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """[b, s/sp, h, ...] -> [b, s, h/sp, ...]: send head slice r to rank r, gather sequence."""
    b, s, h, *rest = x.shape
    x = x.reshape(b, s, size, h // size, *rest).transpose(0, 2).transpose(1, 2).contiguous()
    x = all_to_all_single_autograd(x, None, None, group)
    return x.transpose(0, 1).reshape(b, size * s, h // size, *rest)


def sequence_to_ranks(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """[b, s, h/sp, d] -> [b, s/sp, h, d]: the reverse of ``heads_to_ranks``."""
    b, s, h, d = x.shape
    x = x.reshape(b, size, s // size, h, d).transpose(0, 1).contiguous()
    x = all_to_all_single_autograd(x, None, None, group)
    return x.permute(1, 2, 0, 3, 4).reshape(b, s // size, size * h, d)


class SequenceParallel:
    """One SP group: slices batches (``shard``) and wires a decoder for them (``apply``)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def shard(self, batch: Batch) -> Batch:
        """This rank's slice of ``batch`` (see ``shard_batch``)."""
        return shard_batch(batch, self.rank, self.size, self.group)

    def apply(self, model: nn.Module) -> None:
        """Route the sequence core of every token mixer through the all-to-alls. Runs on the
        meta model, before any other wrapper; the rest of the decoder learns of the slice
        from the batch's ``SequenceShard``. Whether the heads split over the ranks is the
        model's layout rule (``ModelSpec.check_layout``), checked with the config."""
        core = UlyssesCore(self.group)
        for mixer in sequence_mixers(model):
            mixer.sequence_core = core


def sequence_mixers(model: nn.Module) -> list[SequenceMixer]:
    """The token mixers of ``model`` whose sequence core a layout may wrap."""
    return [m for m in model.modules() if isinstance(m, SequenceMixer)]


@contextlib.contextmanager
def whole_sequences(model: nn.Module) -> Iterator[None]:
    """Every token mixer on this rank alone while inside: an RL rollout decodes and scores
    whole sequences on every SP rank (no all-to-all between them), then training slices
    them. A model without SP wrappers is left as it is."""
    mixers = sequence_mixers(model)
    cores = [mixer.sequence_core for mixer in mixers]
    for mixer in mixers:
        mixer.sequence_core = local_core
    try:
        yield
    finally:
        for mixer, core in zip(mixers, cores, strict=True):
            mixer.sequence_core = core
