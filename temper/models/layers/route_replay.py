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
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from temper.models.layers.moe import MoE, moe_layers

ROUTES = "routes"
"""A batch's field of routes to replay, [b, s, moe_layers, top_k]."""

ROUTE_DTYPE = torch.int16
"""Expert ids as stored in a batch and a checkpoint (any expert count below 32768)."""


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
    that layer's list (the yielded list of lists, one per layer); see ``stacked``."""
    layers = routed_layers(model)
    record: list[list[torch.Tensor]] = [[] for _ in layers]
    for layer, own in zip(layers, record, strict=True):
        layer.record = own
    try:
        yield record
    finally:
        for layer in layers:
            layer.record = None


def stacked(record: list[list[torch.Tensor]]) -> torch.Tensor:
    """A record of forwards over consecutive columns (a prefill, then one column per decode
    step) as routes [b, columns, moe_layers, top_k]."""
    return torch.stack([torch.cat(forwards, dim=1) for forwards in record], dim=2)


@contextmanager
def replaying_routes(model: nn.Module, routes: torch.Tensor | None) -> Iterator[None]:
    """Inside, ``model``'s forwards on [b, s] tokens route them as ``routes``
    [b, s, moe_layers, top_k] say (None: as the router chooses). Whatever was replayed before
    is restored on exit, so the scopes nest (a loss inside the step's forward-and-backward
    scope, whose activation-checkpoint recomputation must replay the same routes)."""
    if routes is None:
        yield
        return
    layers = routed_layers(model)
    if routes.dim() != 4 or routes.shape[2] != len(layers):
        raise ValueError(
            f"router replay: routes of shape {list(routes.shape)} for a model with "
            f"{len(layers)} MoE layers (want [b, s, {len(layers)}, top_k])"
        )
    before = [layer.replay for layer in layers]
    for i, layer in enumerate(layers):
        layer.replay = routes[:, :, i]
    try:
        yield
    finally:
        for layer, replay in zip(layers, before, strict=True):
            layer.replay = replay
