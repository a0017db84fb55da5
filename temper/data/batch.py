"""What a batch is, for every part that reads one: a dict of tensors keyed by name."""

from __future__ import annotations

import torch

Batch = dict[str, torch.Tensor]
"""``input_ids`` and ``labels`` [b, s], optional ``position_ids`` (restarting at each packed
document); preference batches prefix them with ``chosen_`` / ``rejected_``."""

IGNORE_INDEX = -100
"""Label value of a position that does not count in the loss."""

DOCUMENT_POSITIONS = "document_position_ids"
"""Batch key of the whole sequence's positions when ``position_ids`` hold a sequence-parallel
slice: documents are found on the whole sequence, which attention sees."""
