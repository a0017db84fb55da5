"""Multi-token prediction (DeepSeek V3): extra depths that each predict one token further.

Depth k (0-based) sees, at position t, the previous depth's hidden state (depth 0: the main
model's final-norm output, the head's input) and the embedding of token t + k + 1, joined as
``eh_proj([enorm(embedding); hnorm(hidden)])``, runs one decoder block over the sequence, and
predicts token t + k + 2 through its own final norm and the model's shared head. The embedding
and head are the main model's, so the draft trains them jointly with the backbone.

The loss of depth k is the cross-entropy summed over the positions whose target lies in the
same document; ``MTPLoss.weighted_sum`` is ``weight / depth`` times the sum over depths, added
to the main loss sum before the trainer's division by the main token count.

Under sequence or context parallelism a depth's next tokens and targets near the end of a
rank's tokens sit on another rank: the ranks' token ids and labels (small integers, no
gradient) are joined into the whole sequence, shifted there, and each rank keeps its own
tokens (``shifted_ids``, ``mtp_loss``); the depth's block runs under the same sequence core as
the main layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from temper.data.batch import IGNORE_INDEX, SequenceShard
from temper.kernels.cross_entropy import linear_log_probs
from temper.models.layers.context import ForwardContext
from temper.models.layers.decoder import Block, BlockAux
from temper.models.layers.init import init_linear
from temper.models.layers.norm import RMSNorm
from temper.models.layers.whole_sequence import local_part, whole_sequence


class MultiTokenPredictor(nn.Module):
    """One MTP depth (HF's ``model.layers.{n_layers + k}``): ``enorm``, ``hnorm``,
    ``eh_proj`` [dim, 2 * dim], a decoder ``block`` and ``norm`` (HF's shared_head.norm)."""

    def __init__(self, dim: int, eps: float, block: Block) -> None:
        super().__init__()
        self.enorm = RMSNorm(dim, eps)
        self.hnorm = RMSNorm(dim, eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = RMSNorm(dim, eps)

    def init_weights(self, std: float, out_std: float) -> None:
        for norm in (self.enorm, self.hnorm, self.norm, self.block.attention_norm):
            norm.reset_parameters()
        self.block.ffn_norm.reset_parameters()
        init_linear(self.eh_proj, std)
        self.block.attention.init_weights(std, out_std)
        self.block.feed_forward.init_weights(std, out_std)

    def forward(
        self, hidden: torch.Tensor, embedded: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, BlockAux]:
        """hidden [b, s, dim] and the next tokens' embeddings [b, s, dim] -> this depth's
        hidden state [b, s, dim] (before ``norm``; the next depth's input) and its block's
        auxiliary outputs (``Block``'s)."""
        normed = (self.enorm(embedded, ctx.kernels), self.hnorm(hidden, ctx.kernels))
        x = self.eh_proj(torch.cat(normed, dim=-1))
        return self.block(x, ctx)


def shift_left(x: torch.Tensor, n: int, fill: int) -> torch.Tensor:
    """x [b, s] moved ``n`` columns left, the last ``n`` columns ``fill``."""
    return F.pad(x[:, n:], (0, min(n, x.shape[1])), value=fill)


def mtp_targets(
    labels: torch.Tensor, position_ids: torch.Tensor | None, ahead: int
) -> torch.Tensor:
    """Depth ``ahead - 1``'s target at each position: the label ``ahead`` columns on, where
    that column is in the same packed document (its position is ``ahead`` more), else ignored."""
    targets = shift_left(labels, ahead, IGNORE_INDEX)
    if position_ids is not None:
        same_doc = shift_left(position_ids, ahead, -1) == position_ids + ahead
        targets = targets.masked_fill(~same_doc, IGNORE_INDEX)
    return targets


@dataclass
class MTPLoss:
    """What the MTP depths of one forward add to a causal-LM loss."""

    weighted_sum: torch.Tensor
    """``weight / depth * sum_k CE_k``: to add to the main loss sum (carries the gradient)."""
    mean: float
    """Cross-entropy per draft token over all depths (a metric)."""
    accuracy: float
    """Share of draft tokens whose argmax is the target: the acceptance of greedy drafting."""


def shifted_ids(input_ids: torch.Tensor, ahead: int, shard: SequenceShard | None) -> torch.Tensor:
    """The token ``ahead`` columns on at each position of ``input_ids`` [b, s] (a rank's tokens
    with ``shard``), wrapping at the real tokens' end as one process's whole row does: the
    wrapped columns' targets are ignored, and causal attention hides them from the rest."""
    if shard is None:
        return input_ids.roll(-ahead, dims=1)
    whole = whole_sequence(input_ids, shard)
    real = shard.real_len or whole.shape[1]
    whole = torch.cat([whole[:, :real].roll(-ahead, dims=1), whole[:, real:]], dim=1)
    return local_part(whole, shard)


def mtp_loss(
    hidden: list[torch.Tensor],
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None,
    weight: float,
    chunk_tokens: int = 1024,
    shard: SequenceShard | None = None,
) -> MTPLoss:
    """The loss of each depth's normed hidden states [b, s, dim] through the shared head. With
    a ``shard`` the inputs are a rank's tokens: each depth's targets come from the whole
    sequence's labels and positions (gathered), and the metrics are the whole sequence's
    (summed over the shard's group)."""
    if shard is None:
        targets = [mtp_targets(labels, position_ids, k + 1) for k in range(len(hidden))]
        return draft_loss(hidden, head_weight, targets, weight, chunk_tokens)
    whole_labels = whole_sequence(labels, shard)
    whole_positions = None if position_ids is None else whole_sequence(position_ids, shard)
    targets = [
        local_part(mtp_targets(whole_labels, whole_positions, k + 1), shard)
        for k in range(len(hidden))
    ]
    return draft_loss(hidden, head_weight, targets, weight, chunk_tokens, shard.group)


def draft_loss(
    hidden: list[torch.Tensor],
    head_weight: torch.Tensor,
    targets: list[torch.Tensor],
    weight: float,
    chunk_tokens: int = 1024,
    group: dist.ProcessGroup | None = None,
) -> MTPLoss:
    """``mtp_loss`` given each depth's ``targets`` [b, s]; with a ``group`` (sequence-parallel
    slices) the metrics are summed over it, so they are the whole sequences'."""
    total, correct, count = head_weight.new_zeros((), dtype=torch.float32), 0, 0
    for h, target in zip(hidden, targets, strict=True):
        log_probs, _ = linear_log_probs(h, head_weight, target, chunk_tokens)
        total = total - log_probs.sum()
        valid = target != IGNORE_INDEX
        with torch.no_grad():
            rows = h[valid].split(chunk_tokens)
            predicted = torch.cat([(r @ head_weight.t()).argmax(-1) for r in rows])
        correct += int((predicted == target[valid]).sum())
        count += int(valid.sum())
    sums = [total.item(), correct, count]
    if group is not None:
        reduced = torch.tensor(sums, dtype=torch.float64, device=total.device)
        dist.all_reduce(reduced, group=group)
        sums = reduced.tolist()
    denominator = max(sums[2], 1)
    return MTPLoss(
        weighted_sum=total * (weight / len(hidden)),
        mean=sums[0] / denominator,
        accuracy=sums[1] / denominator,
    )
