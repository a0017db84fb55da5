"""Token-choice mixture of SwiGLU experts.

The forward is separable steps: route, ``permute`` tokens by expert, grouped GEMMs over the
stacked expert weights, weighted ``unpermute``. An expert-parallel dispatcher sits between
``permute`` and the experts without touching the math on either side.

Two routers: Qwen3-MoE's softmax top-k, and DeepSeek V3's sigmoid, group-limited top-k with an
auxiliary-loss-free balancing bias (``GroupLimitedRouter``, with optional shared experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from temper.kernels.grouped_gemm import grouped_mm
from temper.kernels.moe_permute import permute as permute_rows
from temper.kernels.moe_permute import unpermute
from temper.kernels.swiglu import swiglu
from temper.models.layers.init import init_linear
from temper.models.layers.mlp import FeedForward
from temper.utils.compat import functional_all_reduce


@dataclass
class RoutingStats:
    """One MoE layer's routing in one forward: what the load-balancing loss reads."""

    tokens_per_expert: torch.Tensor
    """[n_experts] int64 count of top-k assignments (no gradient)."""
    prob_sum: torch.Tensor
    """[n_experts] fp32 router probabilities summed over tokens (carries the gradient)."""
    n_tokens: int
    entropy_sum: torch.Tensor | None = None
    """[] fp32 entropy (nats) of each token's router probabilities, summed (no gradient):
    what an observer of the routing reads (temper.trainer.moe_load)."""


@dataclass(frozen=True)
class GroupLimitedRouting:
    """DeepSeek V3's router settings (``GroupLimitedRouter``)."""

    n_groups: int
    """Experts are split into this many equal groups, in expert order."""
    topk_group: int
    """Each token picks its experts from this many groups only."""
    scaling_factor: float
    """Multiplies the routed experts' weights (HF's ``routed_scaling_factor``)."""


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
    """DeepSeek V3's router, as transformers computes it: sigmoid affinities in fp32; a token
    keeps the ``topk_group`` groups whose two best biased affinities sum highest and takes its
    top k experts there by biased affinity; their unbiased affinities are the weights
    (renormalized with ``norm_topk_prob``), times ``scaling_factor``.

    ``expert_bias`` (HF's ``e_score_correction_bias``) is the auxiliary-loss-free balancing
    term: it steers the choice and never the weights, so it needs no gradient, and
    ``update_expert_bias`` moves it against the load counted in ``load`` while training.
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

        Counts the choices into ``load`` in training mode with autograd on. An activation
        checkpoint's recomputation counts a layer's tokens twice (eager; a compiled block
        counts them once), which scales all of that layer's counts alike and so leaves the
        sign of each bias update unchanged.
        """
        scores = F.linear(x.float(), self.gate.weight.float()).sigmoid()
        if experts is None:
            experts = self._choose(scores)
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.scaling_factor
        if self.training and torch.is_grad_enabled():
            self.load += tokens_per_expert(experts, self.load.numel())
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


class GroupedExperts(nn.Module):
    """SwiGLU experts as stacked weights, each in nn.Linear's [out, in] layout so HF's
    per-expert tensors stack without a transpose: w1 (gate), w3 (up) [E, hidden, dim] and
    w2 (down) [E, dim, hidden]."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))

    def init_weights(self, std: float, out_std: float) -> None:
        """``out_std`` is for ``w2``, which writes into the residual stream."""
        for w, s in ((self.w1, std), (self.w3, std), (self.w2, out_std)):
            nn.init.trunc_normal_(w, std=s, a=-3 * s, b=3 * s)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Rows of x [T, dim] sorted by expert; ``offsets`` [E] int32 cumulative group ends."""
        # Under expert parallelism the weights are DTensors sharded by expert; the rows sent
        # here are for this rank's experts only, so the GEMMs take the local shard.
        w1, w3, w2 = (
            w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w3, self.w2)
        )
        h = swiglu(grouped_mm(x, w1.mT, offsets), grouped_mm(x, w3.mT, offsets))
        return grouped_mm(h, w2.mT, offsets)


def permute(
    x: torch.Tensor, experts: torch.Tensor, n_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copy each token once per chosen expert, grouped by expert (token order kept within one).

    x [n, dim], experts [n, k] -> rows [n * k, dim], ``order`` (the flat (token, slot) index of
    each row, for ``unpermute``) and tokens per expert [E] (int64, no host sync).
    """
    order = experts.flatten().argsort(stable=True)
    rows = permute_rows(x, order, experts.shape[1])
    return rows, order, tokens_per_expert(experts, n_experts)


def tokens_per_expert(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[n_experts] int64 count of the choices in ``experts`` (any shape), without a host sync."""
    flat = experts.flatten()
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


class ExpertDispatcher(Protocol):
    """Runs ``experts`` on rows sorted by expert, wherever the experts live: in this process
    (`run_local`) or across an expert-parallel group (`temper.parallel.expert`)."""

    def __call__(
        self, experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """rows [T, dim] sorted by expert, counts [E] tokens per expert -> outputs [T, dim]."""
        ...


def run_local(experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Every expert is here: one grouped GEMM pass over all rows."""
    return experts(rows, counts.cumsum(0, dtype=torch.int32))


class MoE(nn.Module):
    """Router plus grouped experts; keeps the current forward's ``routing`` statistics.

    ``group_limited`` selects DeepSeek V3's router instead of the softmax top-k. With
    ``shared_hidden_dim``, a shared SwiGLU of that width sees every token and adds to the
    routed output (DeepSeek V3's shared experts); ``shared_gate`` scales it per token by
    ``sigmoid(shared_gate(x))`` first (Qwen3-Next, Qwen3.5-MoE). ``router`` and ``experts``
    replace the built-in ones (gpt-oss's, ``temper.models.layers.clamped_moe``), with the same
    call contracts (a router takes the ``experts`` to replay, see ``TopKRouter``).

    Router replay (``temper.models.layers.route_replay``) sets ``record`` or ``replay``.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        n_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        *,
        group_limited: GroupLimitedRouting | None = None,
        shared_hidden_dim: int = 0,
        shared_gate: bool = False,
        router: nn.Module | None = None,
        experts: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.top_k = top_k
        if router is not None:
            self.router = router
        elif group_limited is None:
            self.router = TopKRouter(dim, n_experts, top_k, norm_topk_prob)
        else:
            self.router = GroupLimitedRouter(dim, n_experts, top_k, norm_topk_prob, group_limited)
        self.experts = GroupedExperts(dim, hidden_dim, n_experts) if experts is None else experts
        self.shared_experts = FeedForward(dim, shared_hidden_dim) if shared_hidden_dim else None
        self.shared_gate = nn.Linear(dim, 1, bias=False) if shared_gate else None
        self.routing: RoutingStats | None = None
        """The routing statistics of the current forward, written by the layer's first run
        after whoever owns the forward cleared them (``MoEDecoder`` at each forward: see
        ``clear_routing``). A run that finds them written leaves them: an activation
        checkpoint's recomputation in backward runs the layer again on the same tokens, and
        its statistics, unused, would hold the block's recomputed graph alive."""
        self.dispatcher: ExpertDispatcher = run_local
        self.record: list[torch.Tensor] | None = None
        """With a list, each forward appends the experts it routed to, [b, s, top_k]."""
        self.replay: torch.Tensor | None = None
        """[b, s, top_k] experts that each token of the next forwards goes to, instead of
        the router's choice (its weights still come from the router)."""

    def init_weights(self, std: float, out_std: float) -> None:
        self.router.init_weights(std)
        self.experts.init_weights(std, out_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(std, out_std)
        if self.shared_gate is not None:
            init_linear(self.shared_gate, std)

    def forward(self, x: torch.Tensor, valid_len: int | None = None) -> torch.Tensor:
        """x [b, s, dim]; ``valid_len``: each row's first tokens that are real, the rest
        right padding (sequence parallelism's), which the routing statistics leave out."""
        tokens = x.reshape(-1, x.shape[-1])
        probs, weights, experts = self.router(tokens, self._replayed(x))
        if self.record is not None:
            self.record.append(experts.view(*x.shape[:2], -1))
        rows, order, counts = permute(tokens, experts, self.n_experts)
        out = self.dispatcher(self.experts, rows, counts)
        if self.routing is None:
            if valid_len is None:
                self.routing = RoutingStats(
                    counts, probs.sum(dim=0), tokens.shape[0], _entropy_sum(probs)
                )
            else:
                self.routing = _real_token_routing(x.shape[:2], valid_len, probs, experts)
        out = unpermute(out, order, weights).view_as(x)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_gate is not None:
                shared = self.shared_gate(x).sigmoid() * shared
            out = out + shared
        return out

    def _replayed(self, x: torch.Tensor) -> torch.Tensor | None:
        """``replay`` as [tokens, top_k] int64 for the router; None without one."""
        if self.replay is None:
            return None
        if self.replay.shape[:2] != x.shape[:2]:
            raise ValueError(
                f"router replay: routes for [b, s] = {list(self.replay.shape[:2])} but the "
                f"forward has {list(x.shape[:2])}"
            )
        return self.replay.reshape(-1, self.replay.shape[-1]).long()


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """Every MoE layer of ``model`` by its module name, in module order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MoE)}


def clear_routing(model: nn.Module) -> None:
    """Start a forward: each MoE layer of ``model`` records its routing afresh on its next
    run (and only on that one, see ``MoE.routing``)."""
    for layer in moe_layers(model).values():
        layer.routing = None


def _real_token_routing(
    rows: torch.Size, valid_len: int, probs: torch.Tensor, experts: torch.Tensor
) -> RoutingStats:
    """Routing statistics of each of ``rows`` [b, s]'s first ``valid_len`` tokens: a slice of
    the padded layout, so no boolean mask and no host sync. Summed over sequence-parallel
    ranks they are those of the whole unpadded sequence."""
    b, s = rows
    real_probs = probs.view(b, s, -1)[:, :valid_len]
    real_experts = experts.view(b, s, -1)[:, :valid_len]
    counts = tokens_per_expert(real_experts, probs.shape[-1])
    n_tokens = b * real_probs.shape[1]
    return RoutingStats(counts, real_probs.sum(dim=(0, 1)), n_tokens, _entropy_sum(real_probs))


@torch.no_grad()
def _entropy_sum(probs: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of ``-sum_e p_e log p_e``; a zero probability adds nothing."""
    return -torch.special.xlogy(probs, probs).sum()


def load_balancing_loss(stats: list[RoutingStats]) -> torch.Tensor:
    """Switch Transformer's auxiliary loss as transformers computes it for Qwen3-MoE.

    ``E * sum_e f_e * P_e``, where f_e is expert e's share of top-k assignments (summing to k)
    and P_e its mean router probability, both pooled over the tokens of all MoE layers before
    the product (so not a mean of per-layer losses). Only P carries a gradient.

    Under torch.distributed the statistics are summed over all ranks first (with autograd), so
    every rank gets the loss of the gathered global batch, whatever the data/sequence layout.
    """
    counts = torch.stack([s.tokens_per_expert for s in stats]).sum(dim=0).float()
    prob_sum = torch.stack([s.prob_sum for s in stats]).sum(dim=0)
    rows = torch.tensor([float(sum(s.n_tokens for s in stats))], device=prob_sum.device)
    pooled = _sum_over_ranks(torch.cat([counts, rows, prob_sum]))
    n = counts.numel()
    counts, rows, prob_sum = pooled[:n], pooled[n], pooled[n + 1 :]
    return n * torch.sum((counts / rows) * (prob_sum / rows))


def load_imbalance(stats: list[RoutingStats]) -> torch.Tensor:
    """Busiest expert's tokens over the mean tokens per expert, averaged over MoE layers; the
    counts are the global batch's (summed over ranks, as for the load-balancing loss)."""
    counts = _sum_over_ranks(torch.stack([s.tokens_per_expert for s in stats]))
    return (counts.max(dim=1).values / counts.float().mean(dim=1)).mean()


def _sum_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """Sum over all ranks with autograd (the gradient is summed back); identity alone."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return functional_all_reduce(value, "sum", dist.group.WORLD)
    return value
