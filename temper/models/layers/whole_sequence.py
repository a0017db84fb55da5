"""Between one rank's tokens and the whole sequence, for sequence (Ulysses) and context
parallelism alike.

A rank holds ``n`` tokens of each row; the ranks of its ``SequenceShard``'s group together hold
the whole padded sequence. Under Ulysses a rank's tokens are one contiguous run and the group's
slices, joined in rank order, are the sequence; under context parallelism they are the rank's
load-balanced columns, which ``SequenceShard.columns`` lists for the whole group. A part of a
model that needs a token's neighbours (multi-token prediction's next tokens, a vision-language
model's fused image features) joins the ranks' tokens with ``whole_sequence``, works on the
whole sequence and keeps its own tokens with ``local_part``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from temper.data.batch import SequenceShard
from temper.utils.compat import all_to_all_single_autograd


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's x [b, n, ...] of ``group`` joined in rank order: [b, n x ranks, ...]
    (with autograd: each slice's gradient goes back to its rank). Booleans travel as bytes."""
    size = dist.get_world_size(group)
    flag = x.dtype == torch.bool
    sent = (x.to(torch.uint8) if flag else x).unsqueeze(0).expand(size, *x.shape).contiguous()
    got = all_to_all_single_autograd(sent, None, None, group).movedim(0, 1).flatten(1, 2)
    return got.bool() if flag else got


def whole_sequence(x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """Every rank's x [b, n, ...] of ``shard.group`` joined in sequence order: the whole padded
    sequence [b, seq_len, ...], with autograd (each rank gets its tokens' gradient)."""
    joined = gather_sequence(x, shard.group)
    if shard.columns is None:
        return joined
    return joined[:, shard.columns.argsort()]


def local_part(whole: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """This rank's tokens [b, n, ...] of a whole-sequence tensor [b, seq_len, ...], in the
    rank's own order: the inverse of ``whole_sequence`` for this rank."""
    n = shard.seq_len // dist.get_world_size(shard.group)
    if shard.columns is None:
        return whole[:, shard.start : shard.start + n]
    return whole[:, shard.columns[shard.start : shard.start + n]]
