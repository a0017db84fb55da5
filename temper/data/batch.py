"""What a batch is, for every part that reads one: a dict of tensors keyed by name."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceShard:
    """The decoder's input is one rank's slice of each sequence (``temper.parallel.ulysses``):
    its tokens and positions are local, while attention, behind its all-to-alls, sees the
    whole sequence."""

    seq_len: int
    """The whole (right-padded) sequence's length: attention's masks are built at it."""
    valid_len: int
    """Tokens of each row of the slice that are real; the rest is the padding that made the
    sequence divisible, which MoE routing statistics leave out."""
    start: int = 0
    """Where the slice starts in the whole sequence (a vision-language model slices its fused
    embeddings there)."""


Batch = dict[str, "torch.Tensor | SequenceShard"]
"""``input_ids`` and ``labels`` [b, s], optional ``position_ids`` (restarting at each packed
document); preference batches prefix them with ``chosen_`` / ``rejected_``; a
sequence-parallel slice also holds its ``SequenceShard`` under ``SEQUENCE_SHARD``."""

IGNORE_INDEX = -100
"""Label value of a position that does not count in the loss."""

DOCUMENT_POSITIONS = "document_position_ids"
"""Batch key of the whole sequence's positions when ``position_ids`` hold a sequence-parallel
slice: documents are found on the whole sequence, which attention sees."""

SEQUENCE_SHARD = "sequence_shard"
"""Batch key of the ``SequenceShard`` of a sequence-parallel slice, which the model takes."""
