"""Router replay (R3, "rollout routing replay"): the experts each token was routed to when a
rollout sampled it, recorded and then imposed on later forwards of the same tokens.

A token's top-k choice is discontinuous: two experts whose scores tie, or differ only at
rounding level, can swap between the sampler's forwards (prefill and one-token decode steps
on a KV cache) and the trainer's full-sequence forward. The trainer's policy then differs
from the one that sampled, and the first update's importance ratio is not 1. Replaying the
recorded experts fixes each token's choice; the weights still come from the current router's
scores at those experts, so the router keeps its gradient, and the routing statistics (the
load-balancing loss, the expert load) count the replayed choices.

Routes are [rows, width, moe_layers, top_k] in ``ROUTE_DTYPE``, one entry per MoE layer of
the decoder's blocks (``model.layers``) in order.

Both directions pass through the forward, never through the layers' attributes: the routes to
impose go in through each forward's ``ForwardContext`` (the decoder puts its
``router_replay`` there), so an activation checkpoint's recomputation, which reruns a block
with the context its forward had, routes as that forward did; the routes taken come out with
the layers' statistics (``RoutingStats.experts``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from temper.models.layers.moe import MoE, RoutingStats, moe_layers

ROUTES = "routes"
"""A batch's field of routes to replay, [b, s, moe_layers, top_k]."""

ROUTE_DTYPE = torch.int16
"""Expert ids as stored in a batch and a checkpoint (any expert count below 32768)."""


@dataclass
class RouterReplay:
    """A decoder's router-replay inputs (its ``router_replay``), set by the scopes below and
    put into each of its forwards' ``ForwardContext``."""

    routes: torch.Tensor | None = None
    """[b, s, moe_layers, top_k]: the experts the next forwards impose (None: the routers
    choose)."""
    record: list[list[torch.Tensor]] | None = None
    """With a list per MoE layer of the blocks, each forward's MoE layers return the experts
    they routed to (``RoutingStats.experts``) and ``keep`` appends them, [b, s, top_k]."""

    def fields(self, model: nn.Module) -> dict[str, Any]:
        """``ForwardContext``'s router-replay fields for a forward of ``model``'s blocks: each
        block's routes [b, s, top_k] (None for a block without routed experts) and the record
        flag."""
        record = self.record is not None
        if self.routes is None:
            return {"record_routes": record}
        routes = iter(self.routes.unbind(2))
        per_block = tuple(next(routes) if moe_layers(block) else None for block in model.layers)
        return {"routes": per_block, "record_routes": record}

    def keep(self, routing: list[RoutingStats]) -> None:
        """After a forward, while recording: append the experts in ``routing`` (the forward's
        statistics, the blocks' MoE layers first) to each layer's list."""
        if self.record is not None:
            for own, stats in zip(self.record, routing[: len(self.record)], strict=True):
                own.append(stats.experts)


def routed_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of ``model``'s decoder blocks, in order; ValueError for a model without
    routed experts."""
    layers = list(moe_layers(model.layers).values())
    if not layers:
        raise ValueError(
            f"objective.router_replay needs a model with routed experts; "
            f"{type(model).__name__} has no MoE layer"
        )
    return layers


@contextmanager
def recording_routes(model: nn.Module) -> Iterator[list[list[torch.Tensor]]]:
    """Inside, every forward of ``model`` appends each MoE layer's experts [b, s, top_k] to
    that layer's list (the yielded list of lists, one per layer); see ``stacked``. The layers
    return them with their statistics, and the decoder keeps them (``RouterReplay.keep``)."""
    record: list[list[torch.Tensor]] = [[] for _ in routed_layers(model)]
    before = model.router_replay.record
    model.router_replay.record = record
    try:
        yield record
    finally:
        model.router_replay.record = before


def stacked(record: list[list[torch.Tensor]]) -> torch.Tensor:
    """A record of forwards over consecutive columns (a prefill, then one column per decode
    step) as routes [b, columns, moe_layers, top_k]."""
    return torch.stack([torch.cat(forwards, dim=1) for forwards in record], dim=2)


@contextmanager
def replaying_routes(model: nn.Module, routes: torch.Tensor | None) -> Iterator[None]:
    """Inside, ``model``'s forwards on [b, s] tokens route them as ``routes``
    [b, s, moe_layers, top_k] say (None: as the router chooses). Whatever was replayed before
    is restored on exit, so the scopes nest. Only the forward needs the scope: an activation
    checkpoint's recomputation reuses its forward's context, routes included."""
    if routes is None:
        yield
        return
    layers = routed_layers(model)
    if routes.dim() != 4 or routes.shape[2] != len(layers):
        raise ValueError(
            f"router replay: routes of shape {list(routes.shape)} for a model with "
            f"{len(layers)} MoE layers (want [b, s, {len(layers)}, top_k])"
        )
    before = model.router_replay.routes
    model.router_replay.routes = routes
    try:
        yield
    finally:
        model.router_replay.routes = before
