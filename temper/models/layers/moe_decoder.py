"""The decoder skeleton of mixture-of-experts families: what every MoE family reads from its
routed layers, stated once (routing statistics, load-balancing loss, load imbalance, active
parameters). A family states only which layers are MoE and how (``feed_forward``)."""

from __future__ import annotations

import torch

from temper.models.layers.decoder import Decoder
from temper.models.layers.moe import RoutingStats, load_balancing_loss, load_imbalance, moe_layers


class MoEDecoder(Decoder):
    """A ``Decoder`` with MoE MLPs in some layers; its args carry ``top_k`` and ``n_experts``.

    Its blocks return their MoE layers' routing statistics and each forward collects them
    (``last_routing``), so they are that forward's, whatever an activation checkpoint
    recomputes. They give ``aux_loss`` (load balancing, before the family's
    ``router_aux_loss_coef``) and ``load_imbalance``, which the causal-LM objective reads."""

    def routing(self) -> list[RoutingStats]:
        """The routing of each MoE layer that ran in the latest forward (DeepSeek's
        multi-token-prediction depths run in training mode only)."""
        if not self.last_routing:
            raise RuntimeError("no routing statistics: run a forward with MoE layers first")
        return self.last_routing

    def aux_loss(self) -> torch.Tensor:
        """The load-balancing loss of the latest forward, before ``router_aux_loss_coef``."""
        return load_balancing_loss(self.routing())

    def load_imbalance(self) -> torch.Tensor:
        return load_imbalance(self.routing())

    def active_params(self, trainable: bool | None = None) -> float:
        """As the dense count (of the trainable or frozen weights only, when ``trainable`` is
        given), but each token multiplies only top_k of n_experts routed expert weights
        (shared experts count in full)."""
        args = self.args
        experts = sum(
            p.numel()
            for m in moe_layers(self).values()
            for p in m.experts.parameters()
            if trainable is None or p.requires_grad == trainable
        )
        return super().active_params(trainable) - experts * (1 - args.top_k / args.n_experts)
