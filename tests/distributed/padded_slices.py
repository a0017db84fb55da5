"""Ulysses slices against one process on the same rows: a debug model built twice with the same
weights, one whole and one under sequence parallelism over the world, each taking the loss and
its gradients on 79 tokens (padded to 80 over 2 ranks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from temper.parallel.ulysses import SequenceParallel

Extras = Callable[[torch.nn.Module, dict[str, Any]], dict[str, Any]]
"""(model, the loss's metrics) -> more values to compare, read after the backward."""


def sp_and_reference(
    family: str,
    overrides: dict[str, Any] | None = None,
    layout: Callable[[], Any] | None = None,
) -> tuple[torch.nn.Module, torch.nn.Module, SequenceParallel]:
    """In a rank (the runtime started here): the debug model whole (seed 0) and the same
    weights under Ulysses sequence parallelism over the world (or the layout that ``layout``
    builds once the runtime is up: a ``ContextParallel``), with its layout."""
    import torch.distributed as dist

    from temper.models import build_model, materialize
    from temper.parallel.ulysses import SequenceParallel
    from temper.utils.device import init_runtime

    init_runtime()
    torch.manual_seed(0)
    reference = materialize(build_model(family, "debug", overrides=overrides), "cpu")
    model = build_model(family, "debug", overrides=overrides)
    sp = SequenceParallel(dist.group.WORLD) if layout is None else layout()
    sp.apply(model)
    model = materialize(model, "cpu")
    model.load_state_dict(reference.state_dict())
    return reference, model, sp


def padded_slices_rank(
    family: str, overrides: dict[str, Any], packed: bool, extras: Extras
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """On rank 0: (the slices' loss summed over ranks, with every gradient summed over ranks;
    one process's on the whole rows), each with ``extras``. ``packed``: documents of 70 and 9."""
    import torch.distributed as dist

    from temper.objectives import CausalLM

    reference, model, sp = sp_and_reference(family, overrides)

    ids = torch.randint(1, 1000, (2, 79), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.roll(-1, dims=1)}
    if packed:
        batch["position_ids"] = torch.cat([torch.arange(70), torch.arange(9)]).expand(2, 79)
    shard = sp.shard(batch)

    def run(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        loss, _, metrics = CausalLM().loss(model, batch)
        loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            if model is not reference:
                dist.all_reduce(grad)
            grads[name] = grad
        return {"loss": loss.detach(), **extras(model, metrics), "grads": grads}

    got = run(model, shard)
    dist.all_reduce(got["loss"])
    want = run(reference, batch)
    dist.barrier()
    return (got, want) if dist.get_rank() == 0 else None
