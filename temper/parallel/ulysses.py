"""Ulysses sequence parallelism: each SP rank holds a slice of the sequence, attention (and
Gated DeltaNet's convolution and recurrence) a slice of the heads.

The batch is right-padded to a multiple of SP and sliced along the sequence before the model
call (``SequenceParallel.shard``, the model entry); the slice travels with a
``SequenceShard`` that the objective hands the decoder. Around each attention core an
all-to-all turns q, k, v from sequence-sharded [b, s/sp, h, d] into head-sharded
[b, s, h/sp, d], so attention sees the whole sequence (and masks built at its length), and
the reverse all-to-all brings the output back. Everything else in a block works token by
token.

Padding keeps out of the results: pad tokens carry label -100 (no loss, no token count) and
position ``PAD_POSITION``, which makes each pad its own one-token document in the global mask,
so no real token attends to one; the ``SequenceShard``'s ``valid_len`` keeps them out of MoE
routing statistics.
"""

from __future__ import annotations

import contextlib
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
from temper.kernels.attention import Backend, DocumentMask
from temper.kernels.attention import attention as causal_attention
from temper.models.fit import check_heads, check_linear_attention_heads, check_mtp
from temper.models.layers.gated_deltanet import GatedDeltaNet, gated_delta_mix
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
        s + pad, min(max(s - start, 0), local), group=group, start=start
    )
    if "rope_position_ids" in batch:  # a vision-language batch: see below
        rope = F.pad(batch["rope_position_ids"], (0, pad))
        shard["rope_position_ids"] = rope[..., start : start + local]
    if "pixel_values" in batch:
        shard["pixel_values"], shard["image_grid_thw"] = (
            batch["pixel_values"],
            batch["image_grid_thw"],
        )
        shard[FUSION_INPUT_IDS] = padded["input_ids"]
    return shard


def _side(batch: Batch, side: str) -> Batch:
    return {key.removeprefix(side): v for key, v in batch.items() if key.startswith(side)}


class UlyssesAttention:
    """The attention core between two all-to-alls over the SP ``group``; a drop-in for
    ``temper.kernels.attention.attention`` on sequence-sharded q, k, v."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        docs: DocumentMask | None = None,
        *,
        backend: Backend = "auto",
        scale: float | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``sinks`` [h] are per head: this rank attends with those of its head slice."""
        if k.shape[2] < self.size:
            k, v = (t.repeat_interleave(self.size // k.shape[2], dim=2) for t in (k, v))
        q, k, v = (self._heads_to_ranks(t) for t in (q, k, v))
        if sinks is not None:
            sinks = sinks.view(self.size, -1)[self.rank]
        out = causal_attention(
            q, k, v, docs, backend=backend, scale=scale, window=window, sinks=sinks
        )
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

    def shard(self, batch: Batch) -> Batch:
        """This rank's slice of ``batch`` (see ``shard_batch``)."""
        return shard_batch(batch, self.rank, self.size, self.group)

    def apply(self, model: nn.Module) -> None:
        """Route every attention core through the all-to-alls. Runs on the meta model, before
        any other wrapper; the rest of the decoder learns of the slice from the batch's
        ``SequenceShard``."""
        args = model.args
        check_heads(args.n_heads, getattr(args, "n_kv_heads", args.n_heads), self.size)
        check_mtp(getattr(args, "mtp_depth", 0))
        attend = UlyssesAttention(self.group)
        mix = UlyssesGatedDeltaNet(self.group)
        for block in model.layers:
            mixer = block.attention
            if isinstance(mixer, GatedDeltaNet):
                check_linear_attention_heads(mixer.n_k_heads, mixer.n_v_heads, self.size)
                mixer.mix = mix
            else:
                mixer.attend = attend


@contextlib.contextmanager
def whole_sequences(model: nn.Module) -> Iterator[None]:
    """Attention and Gated DeltaNet's mix on this rank alone while inside: an RL rollout
    decodes and scores whole sequences on every SP rank (no all-to-all between them), then
    training slices them. A model without SP wrappers is left as it is."""
    swapped: list[tuple[nn.Module, str, object]] = []
    for block in model.layers:
        mixer = block.attention
        if isinstance(mixer, GatedDeltaNet):
            if isinstance(mixer.mix, UlyssesGatedDeltaNet):
                swapped.append((mixer, "mix", mixer.mix))
                mixer.mix = gated_delta_mix
        elif isinstance(mixer.attend, UlyssesAttention):
            swapped.append((mixer, "attend", mixer.attend))
            mixer.attend = causal_attention
    try:
        yield
    finally:
        for mixer, name, wrapper in swapped:
            setattr(mixer, name, wrapper)
