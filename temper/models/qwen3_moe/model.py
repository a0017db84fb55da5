"""Qwen3-MoE: the Qwen3 decoder with token-choice expert MLPs in the sparse layers."""

import torch
from torch import nn

from temper.models.layers.mlp import FeedForward
from temper.models.layers.moe import (
    MoE,
    RoutingStats,
    load_balancing_loss,
    load_imbalance,
)
from temper.models.qwen3.model import Qwen3Transformer
from temper.models.qwen3_moe.args import Qwen3MoeArgs


class Qwen3MoeTransformer(Qwen3Transformer):
    """Qwen3 whose MLP is an MoE where ``args.is_moe_layer``; the latest forward's routing
    gives ``aux_loss`` (load balancing, unscaled) and ``load_imbalance``."""

    args: Qwen3MoeArgs

    def feed_forward(self, layer_id: int) -> nn.Module:
        args = self.args
        if not args.is_moe_layer(layer_id):
            return FeedForward(args.dim, args.ffn_hidden_dim)
        return MoE(args.dim, args.moe_hidden_dim, args.n_experts, args.top_k, args.norm_topk_prob)

    def routing(self) -> list[RoutingStats]:
        """Each MoE layer's routing in the latest forward."""
        stats = [m.routing for m in self.modules() if isinstance(m, MoE)]
        if not stats or any(s is None for s in stats):
            raise RuntimeError("no routing statistics: run a forward with MoE layers first")
        return stats

    def aux_loss(self) -> torch.Tensor:
        """The load-balancing loss of the latest forward, before ``router_aux_loss_coef``."""
        return load_balancing_loss(self.routing())

    def load_imbalance(self) -> torch.Tensor:
        return load_imbalance(self.routing())

    def active_params(self, trainable: bool | None = None) -> float:
        """As Qwen3's, but each token multiplies only top_k of n_experts expert weights."""
        args = self.args
        experts = sum(
            p.numel()
            for m in self.modules()
            if isinstance(m, MoE)
            for p in m.experts.parameters()
            if trainable is None or p.requires_grad == trainable
        )
        return super().active_params(trainable) - experts * (1 - args.top_k / args.n_experts)
