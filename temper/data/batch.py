"""What a batch is, for every part that reads one: a dict of tensors keyed by name."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class SequenceShard:
    """The decoder's input is one rank's slice of each sequence (``temper.parallel.ulysses``,
    ``temper.parallel.context_parallel``): its tokens and positions are local, while
    attention, behind its all-to-alls or its ring, sees the whole sequence."""

    seq_len: int
    """The whole (right-padded) sequence's length: attention's masks are built at it."""
    valid_len: int
    """Tokens of each row of the slice that are real; the rest is the padding that made the
    sequence divisible, which MoE routing statistics leave out."""
    group: ProcessGroup | None = None
    """The group holding the other slices (SP, CP, or CP x SP in (cp, sp) rank order): an
    objective that sums over whole sequences (DPO) reduces its per-slice sums over it."""
    start: int = 0
    """Where the slice starts among the group's slices joined in rank order: in the whole
    sequence under Ulysses, in ``columns`` under context parallelism (see
    ``temper.models.layers.whole_sequence``)."""
    real_len: int | None = None
    """The whole sequence's real tokens, before the padding (None: all ``seq_len``): DeepSeek
    sparse attention chooses among exactly the keys one process would."""
    columns: torch.Tensor | None = None
    """[seq_len] the whole padded sequence's column of each token of the group's slices joined
    in rank order: context parallelism's load-balanced layout. None: the joined slices are the
    sequence (Ulysses' contiguous slices)."""


Batch = dict[str, "torch.Tensor | SequenceShard"]
"""``input_ids`` and ``labels`` [b, s], optional ``position_ids`` (restarting at each packed
document); preference batches prefix them with ``chosen_`` / ``rejected_``; a
sequence-parallel slice also holds its ``SequenceShard`` under ``SEQUENCE_SHARD``."""

REAL_TOKENS = "real_tokens"
"""Batch key [b] (``chosen_``/``rejected_`` prefixed for preference rows): how many of each
row's positions are not padding (a row's padding comes last). Rows without it are all real
(packed text). Only the throughput reads it."""

IGNORE_INDEX = -100
"""Label value of a position that does not count in the loss."""

DOCUMENT_POSITIONS = "document_position_ids"
"""Batch key of the whole sequence's positions when ``position_ids`` hold a sequence-parallel
slice: documents are found on the whole sequence, which attention sees."""

SEQUENCE_SHARD = "sequence_shard"
"""Batch key of the ``SequenceShard`` of a sequence-parallel slice, which the model takes."""

MEDIA_KEYS = ("pixel_values", "image_grid_thw", "rope_position_ids")
"""Keys of a vision-language batch that the model takes beside the tokens: the images'
patches [n, patch_dim] and grids [images, 3] (all rows' images, in order, never sliced),
and the multimodal rotary positions [3, b, s] (sliced with the tokens)."""

FUSION_INPUT_IDS = "fusion_input_ids"
"""Batch key of the whole sequence's token ids in a sequence-parallel slice with images: the
model fuses the images into the whole sequence, then keeps its slice."""

MODEL_INPUT_KEYS = (*MEDIA_KEYS, FUSION_INPUT_IDS)
"""The keyword inputs a vision-language model's ``forward`` and ``hidden_states`` take."""


def model_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    """The keyword inputs of ``batch`` beyond the tokens (``MODEL_INPUT_KEYS``; none for text)."""
    return {k: batch[k] for k in MODEL_INPUT_KEYS if k in batch}  # type: ignore[misc]


def pad_tokens(t: torch.Tensor, pad: int, value: float = 0) -> torch.Tensor:
    """A per-token field [b, s, ...] right-padded by ``pad`` positions along s (its trailing
    dims, a rollout's routes [b, s, layers, k], kept as they are)."""
    return F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad), value=value)


def real_shares(batch: Batch) -> dict[str, float]:
    """``real_share`` of each kind of row in ``batch`` (a DPO pair's two), by its ids' key."""
    ids = [key for key in batch if key.endswith("input_ids")]
    return {key: real_share(batch, key.removesuffix("input_ids")) for key in ids}


def real_share(batch: Batch, prefix: str = "") -> float:
    """The share of the ``{prefix}input_ids`` positions that are real tokens (1 where the
    batch does not say): read on the host, before the batch moves, so it syncs nothing."""
    real = batch.get(prefix + REAL_TOKENS)
    if real is None:
        return 1.0
    ids = batch[prefix + "input_ids"]
    return float(real.sum()) / ids.numel()  # type: ignore[union-attr]
