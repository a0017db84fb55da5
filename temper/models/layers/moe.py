"""Token-choice mixture of SwiGLU experts: the layer, its routing statistics and the
load-balancing loss they give.

The statistics are an output of the layer (``MoE.forward`` returns them beside its hidden
state), not state it keeps: an activation checkpoint's recomputation runs the layer again and
its second output is simply dropped, and torch.compile traces the layer with no side effect.
The decoder collects them per forward (``temper.models.layers.moe_decoder``).

The forward is separable steps: route (``temper.models.layers.routers``), ``permute`` tokens
by expert, grouped GEMMs over the stacked expert weights (``temper.models.layers.experts``),
weighted ``unpermute``. An expert-parallel dispatcher sits between ``permute`` and the
experts without touching the math on either side.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from temper.kernels.moe_permute import unpermute
from temper.models.layers.context import ForwardContext
from temper.models.layers.experts import (
    ExpertDispatcher,
    GroupedExperts,
    permute,
    run_local,
    tokens_per_expert,
)
from temper.models.layers.init import init_linear
from temper.models.layers.mlp import FeedForward
from temper.models.layers.routers import (
    GroupLimitedRouter,
    GroupLimitedRouting,
    HashRouter,
    TopKRouter,
)
from temper.utils.compat import functional_all_reduce


class RoutingStats(NamedTuple):
    """One MoE layer's routing in one forward, over its real tokens (a sequence-parallel
    slice's padding left out): what the load-balancing loss, the aux-loss-free bias update and
    an observer read. A pytree of tensors (and one int), so activation checkpointing,
    torch.compile and FSDP pass it through as they pass the hidden state."""

    tokens_per_expert: torch.Tensor
    """[n_experts] int64 count of top-k assignments (no gradient)."""
    prob_sum: torch.Tensor
    """[n_experts] fp32 router probabilities summed over tokens (carries the gradient)."""
    n_tokens: int
    entropy_sum: torch.Tensor | None = None
    """[] fp32 entropy (nats) of each token's router probabilities, summed (no gradient):
    what an observer of the routing reads (temper.trainer.moe_load)."""
    experts: torch.Tensor | None = None
    """[b, s, top_k] the experts each token went to, padding included, when the forward's
    context asks for them (``ForwardContext.record_routes``: router replay's record)."""


class MoE(nn.Module):
    """Router plus grouped experts; ``forward`` returns the output and its ``RoutingStats``.

    ``group_limited`` selects DeepSeek V3's router instead of the softmax top-k. With
    ``shared_hidden_dim``, a shared SwiGLU of that width sees every token and adds to the
    routed output (DeepSeek V3's shared experts); ``shared_gate`` scales it per token by
    ``sigmoid(shared_gate(x))`` first (Qwen3-Next, Qwen3.5-MoE). ``router`` and ``experts``
    replace the built-in ones (gpt-oss's, ``temper.models.layers.clamped_moe``), with the same
    call contracts (a router takes the ``experts`` to replay, see ``TopKRouter``; a
    ``HashRouter`` also the tokens' ids, from ``ctx.token_ids``).

    Router replay (``temper.models.layers.route_replay``) comes in through the forward's
    context: ``ctx.route`` imposes the experts, ``ctx.record_routes`` returns them.
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
        self._dispatcher: ExpertDispatcher = run_local
        self.hashed = isinstance(self.router, HashRouter)
        """The router chooses by token id (``ForwardContext.token_ids``), not by hidden state."""

    def init_weights(self, std: float, out_std: float) -> None:
        self.router.init_weights(std)
        self.experts.init_weights(std, out_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(std, out_std)
        if self.shared_gate is not None:
            init_linear(self.shared_gate, std)

    def use_dispatcher(self, dispatcher: ExpertDispatcher) -> None:
        """Send the permuted rows to the experts through ``dispatcher`` from now on (the layout
        chooses it: expert parallelism's all-to-all, the dry run's measuring stand-in);
        ``run_local`` by default."""
        self._dispatcher = dispatcher

    def forward(
        self, x: torch.Tensor, ctx: ForwardContext | None = None
    ) -> tuple[torch.Tensor, RoutingStats]:
        """x [b, s, dim] -> the output [b, s, dim] and this forward's routing statistics, which
        leave out the right padding of a sequence-parallel slice (after ``ctx.valid_len``
        tokens of each row). ``ctx.route`` [b, s, top_k] replaces the router's choice."""
        valid_len = None if ctx is None else ctx.valid_len
        tokens = x.reshape(-1, x.shape[-1])
        if self.hashed:
            probs, weights, experts = self.router(tokens, _replayed(x, ctx), _token_ids(x, ctx))
        else:
            probs, weights, experts = self.router(tokens, _replayed(x, ctx))
        impl = None if ctx is None else ctx.kernels.moe_permute
        rows, order, counts = permute(tokens, experts, self.n_experts, impl)
        run = self.experts if ctx is None else partial(self.experts, kernels=ctx.kernels)
        out = self._dispatcher(run, rows, counts)
        recorded = experts.view(*x.shape[:2], -1) if ctx is not None and ctx.record_routes else None
        if valid_len is None:
            stats = RoutingStats(
                counts, probs.sum(dim=0), tokens.shape[0], _entropy_sum(probs), recorded
            )
        else:
            real_probs = _real(x.shape[:2], valid_len, probs)
            stats = RoutingStats(
                tokens_per_expert(_real(x.shape[:2], valid_len, experts), self.n_experts),
                real_probs.sum(dim=(0, 1)),
                real_probs.shape[0] * real_probs.shape[1],
                _entropy_sum(real_probs),
                recorded,
            )
        out = unpermute(out, order, weights, impl).view_as(x)
        if self.shared_experts is not None:
            shared = self.shared_experts(x, ctx)
            if self.shared_gate is not None:
                shared = self.shared_gate(x).sigmoid() * shared
            out = out + shared
        return out, stats


def _replayed(x: torch.Tensor, ctx: ForwardContext | None) -> torch.Tensor | None:
    """The context's ``route`` as [tokens, top_k] int64 for the router; None without one."""
    route = None if ctx is None else ctx.route
    if route is None:
        return None
    if route.shape[:2] != x.shape[:2]:
        raise ValueError(
            f"router replay: routes for [b, s] = {list(route.shape[:2])} but the "
            f"forward has {list(x.shape[:2])}"
        )
    return route.reshape(-1, route.shape[-1]).long()


def _token_ids(x: torch.Tensor, ctx: ForwardContext | None) -> torch.Tensor:
    """The context's ``token_ids`` as [tokens] for a hash router; ValueError without them."""
    ids = None if ctx is None else ctx.token_ids
    if ids is None or ids.shape != x.shape[:2]:
        raise ValueError(
            "a hash-routed MoE layer needs its forward's token ids for [b, s] = "
            f"{list(x.shape[:2])} in ForwardContext.token_ids"
        )
    return ids.flatten()


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """Every MoE layer of ``model`` by its module name, in module order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MoE)}


def keep_routing(routing: list[RoutingStats], moe: nn.Module, stats: RoutingStats | None) -> None:
    """Collect the statistics ``stats`` of the MoE layer ``moe`` in one forward (None: a dense
    block's, nothing to keep) into ``routing``. The decoder calls it at its top level, outside
    any checkpointed or compiled block. In a training forward with autograd on it also adds the
    real tokens' assignments to the ``load`` of a balancing router (``GroupLimitedRouter``;
    other routers keep none): counted here, once per forward, a recomputation never counts
    them again. Padding stays out: counted, it would pull the bias of the experts padding goes
    to, and one process, without that padding, would move it differently."""
    if stats is None:
        return
    routing.append(stats)
    router = moe.router
    if isinstance(router, GroupLimitedRouter) and router.training and torch.is_grad_enabled():
        router.load += stats.tokens_per_expert


def _real(rows: torch.Size, valid_len: int, per_token: torch.Tensor) -> torch.Tensor:
    """``per_token`` [b * s, ...] of ``rows`` [b, s] as [b, valid_len, ...]: each row's first
    ``valid_len`` tokens, a slice of the padded layout (no boolean mask, no host sync). Summed
    over sequence-parallel ranks, statistics of these are those of the whole unpadded
    sequence."""
    b, s = rows
    return per_token.view(b, s, -1)[:, :valid_len]


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
