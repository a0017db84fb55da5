"""The routers of the MoE layer (``temper.models.layers.moe.MoE``): each maps tokens to
router probabilities over the experts, the top-k experts each token goes to and their weights.

Qwen3-MoE's softmax top-k (``TopKRouter``); DeepSeek V3's sigmoid, group-limited top-k with
an auxiliary-loss-free balancing bias (``GroupLimitedRouter``, ``update_expert_bias``), which
DeepSeek V4 runs with one group and ``sqrtsoftplus`` scores; and V4's ``HashRouter``, whose
experts are a fixed function of the token id.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from temper.models.layers.init import init_linear

Scoring = Literal["sigmoid", "sqrtsoftplus"]


def sqrtsoftplus(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(softplus(x))``: DeepSeek V4's expert affinities, positive and growing like
    ``sqrt(x)`` rather than saturating as the sigmoid does."""
    return F.softplus(x).sqrt()


SCORES: dict[Scoring, Callable[[torch.Tensor], torch.Tensor]] = {
    "sigmoid": torch.sigmoid,
    "sqrtsoftplus": sqrtsoftplus,
}


@dataclass(frozen=True)
class GroupLimitedRouting:
    """DeepSeek V3's router settings (``GroupLimitedRouter``)."""

    n_groups: int
    """Experts are split into this many equal groups, in expert order."""
    topk_group: int
    """Each token picks its experts from this many groups only."""
    scaling_factor: float
    """Multiplies the routed experts' weights (HF's ``routed_scaling_factor``)."""
    scoring: Scoring = "sigmoid"
    """The affinity of a token to an expert from its router logit (HF's ``scoring_func``)."""


class TopKRouter(nn.Module):
    """Softmax over all experts in fp32, then the top k; with ``norm_topk_prob`` the k weights
    are rescaled to sum to 1. This is Qwen3-MoE's order (softmax before top-k)."""

    def __init__(self, dim: int, n_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(dim, n_experts, bias=False)

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [n, dim] -> probabilities [n, E] (fp32), weights [n, k] (x's dtype), experts [n, k].
        ``experts`` [n, k] (router replay): take these instead of the top k; their weights
        are still the router's probabilities, so the gate gets its gradient."""
        logits = self.gate(x)
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        if experts is None:
            weights, experts = probs.topk(self.top_k, dim=-1)
        else:
            weights = probs.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights.to(logits.dtype), experts

    def init_weights(self, std: float) -> None:
        init_linear(self.gate, std)


class GroupLimitedRouter(nn.Module):
    """DeepSeek V3's router, as transformers computes it: sigmoid affinities in fp32 (V4's
    ``sqrtsoftplus`` with ``scoring``); a token keeps the ``topk_group`` groups whose two best
    biased affinities sum highest and takes its top k experts there by biased affinity; their
    unbiased affinities are the weights (renormalized with ``norm_topk_prob``), times
    ``scaling_factor``.

    ``expert_bias`` (HF's ``e_score_correction_bias``) is the auxiliary-loss-free balancing
    term: it steers the choice and never the weights, so it needs no gradient, and
    ``update_expert_bias`` moves it against ``load``, the real tokens' assignments that the
    decoder adds from each training forward's routing statistics
    (``temper.models.layers.moe.count_load``).
    """

    def __init__(
        self, dim: int, n_experts: int, top_k: int, norm_topk_prob: bool, r: GroupLimitedRouting
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.n_groups = r.n_groups
        self.topk_group = r.topk_group
        self.scaling_factor = r.scaling_factor
        self.score = SCORES[r.scoring]
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(n_experts))
        # Not checkpointed: update_expert_bias empties it at every optimizer step.
        self.register_buffer("load", torch.zeros(n_experts, dtype=torch.int64), persistent=False)

    def init_weights(self, std: float) -> None:
        init_linear(self.gate, std)
        nn.init.zeros_(self.expert_bias)
        self.load.zero_()

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [n, dim] -> probabilities [n, E] (fp32 affinities normalized over experts, what the
        load-balancing loss reads), weights [n, k] (x's dtype), experts [n, k].
        ``experts`` [n, k] (router replay): take these instead of choosing, weighted by their
        affinities as chosen ones would be.
        """
        scores = self.score(F.linear(x.float(), self.gate.weight.float()))
        if experts is None:
            experts = self._choose(scores)
        weights = chosen_weights(scores, experts, self.norm_topk_prob, self.scaling_factor)
        probs = scores / scores.sum(dim=-1, keepdim=True)
        return probs, weights.to(x.dtype), experts

    def _choose(self, scores: torch.Tensor) -> torch.Tensor:
        """The top k experts [n, k] by biased affinity within each token's best groups."""
        n = scores.shape[0]
        biased = (scores + self.expert_bias).view(n, self.n_groups, -1)
        group_scores = biased.topk(2, dim=-1).values.sum(dim=-1)
        groups = group_scores.topk(self.topk_group, dim=-1).indices
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        biased = biased.masked_fill(~kept.unsqueeze(-1), float("-inf")).view(n, -1)
        return biased.topk(self.top_k, dim=-1).indices


def chosen_weights(
    scores: torch.Tensor, experts: torch.Tensor, normalize: bool, scaling_factor: float
) -> torch.Tensor:
    """The affinities ``scores`` [n, E] of the chosen ``experts`` [n, k], rescaled to sum to 1
    with ``normalize``, times ``scaling_factor``."""
    weights = scores.gather(1, experts)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling_factor


class HashRouter(nn.Module):
    """DeepSeek V4's hash routing: token id t goes to the experts ``tid2eid[t]`` [top_k], a
    fixed table (loaded from the checkpoint, random distinct experts at init), weighted by its
    learned affinities to them as ``GroupLimitedRouter`` weighs its choice (normalized, times
    ``scaling_factor``). The gate trains; the choice does not. The MoE layer passes the
    tokens' ids from its forward's context (``ForwardContext.token_ids``).
    """

    def __init__(
        self,
        dim: int,
        n_experts: int,
        top_k: int,
        vocab_size: int,
        scaling_factor: float,
        scoring: Scoring = "sqrtsoftplus",
    ) -> None:
        super().__init__()
        self.scaling_factor = scaling_factor
        self.score = SCORES[scoring]
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.register_buffer("tid2eid", torch.zeros(vocab_size, top_k, dtype=torch.int64))

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        init_linear(self.gate, std)
        vocab_size, top_k = self.tid2eid.shape
        noise = torch.rand(vocab_size, self.gate.out_features, device=self.tid2eid.device)
        self.tid2eid.copy_(noise.argsort(dim=-1)[:, :top_k])

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor | None, token_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [n, dim] and its tokens' ids [n] -> probabilities [n, E] (fp32 affinities
        normalized over experts), weights [n, k] (x's dtype), experts [n, k]; ``experts``
        (router replay) replaces the table's choice."""
        scores = self.score(F.linear(x.float(), self.gate.weight.float()))
        if experts is None:
            experts = self.tid2eid[token_ids]
        weights = chosen_weights(scores, experts, True, self.scaling_factor)
        probs = scores / scores.sum(dim=-1, keepdim=True)
        return probs, weights.to(x.dtype), experts


@torch.no_grad()
def update_expert_bias(routers: list[GroupLimitedRouter], rate: float) -> None:
    """Aux-loss-free balancing step (DeepSeek V3): ``bias += rate * sign(mean load - load)`` per
    router, from the tokens each counted since the last call, then the counts restart.

    The counts are summed over the world when torch.distributed is initialized, in one
    all-reduce for all routers, so every rank applies the same update.
    ``rate`` 0 only restarts the counts.
    """
    if routers and rate:
        loads = torch.stack([r.load for r in routers])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(loads)
        loads = loads.float()
        steps = torch.sign(loads.mean(dim=-1, keepdim=True) - loads)
        for router, step in zip(routers, steps, strict=True):
            router.expert_bias.add_(step, alpha=rate)
    for router in routers:
        router.load.zero_()
