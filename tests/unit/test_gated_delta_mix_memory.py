"""Gated DeltaNet's cross-token core keeps only its inputs in autograd and, in its checkpoint,
its matrix products (or nothing, for full activation checkpointing); its recomputed backward
gives the gradients of the stored one exactly."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from temper.models import build_model
from temper.models.layers import gated_deltanet
from temper.models.layers.gated_deltanet import GatedDeltaNet, gated_delta_mix


def _layer_and_inputs() -> tuple[GatedDeltaNet, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = build_model("qwen3_5_moe", "debug", device="cpu", vocab_size=64)
    layer = next(m for m in model.modules() if isinstance(m, GatedDeltaNet))
    x = torch.randn(2, 70, model.args.dim)  # two chunks of 64
    return layer, tuple(t.detach().requires_grad_() for t in layer.project(x) if t is not None)


def test_autograd_saves_only_the_mix_inputs() -> None:
    layer, (q, k, v, _, b, a) = _layer_and_inputs()
    allowed = {t.untyped_storage().data_ptr() for t in (q, k, v, b, a)}
    allowed |= {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gated_delta_mix(layer, q, k, v, b, a)
    # torch 2.11's non-reentrant checkpoint also saves an empty placeholder: no memory.
    held = [t for t in saved if t.untyped_storage().nbytes() > 0]
    assert held
    assert {t.untyped_storage().data_ptr() for t in held} <= allowed


class _CountProducts(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.calls += func in gated_deltanet.MIX_KEPT_OPS
        return func(*args, **(kwargs or {}))


def _products_in_backward(mix, *inputs: torch.Tensor) -> int:  # noqa: ANN001
    out = mix(*inputs)
    with _CountProducts() as count:
        out.sum().backward()
    return count.calls


@pytest.mark.parametrize("keep_products", [True, False])
def test_backward_recomputes_products_only_without_keeping_them(keep_products: bool) -> None:
    """Against the stored mix's backward: with kept products the checkpointed backward runs
    the same products and solves (none again), without it runs the forward's again too."""
    layer, (q, k, v, _, b, a) = _layer_and_inputs()
    stored = _products_in_backward(
        lambda *x: gated_deltanet._mix(layer, *x, None, None, 0, 1), q, k, v, b, a
    )
    with torch.no_grad(), _CountProducts() as forward:
        gated_deltanet._mix(layer, q, k, v, b, a, None, None, 0, 1)
    layer.keep_products = keep_products
    checkpointed = _products_in_backward(lambda *x: gated_delta_mix(layer, *x), q, k, v, b, a)
    assert forward.calls > 0
    if keep_products:
        assert checkpointed == stored
    else:  # the recomputation stops once it has what backward needs (the last state is not)
        assert stored + forward.calls - 1 <= checkpointed <= stored + forward.calls


@pytest.mark.parametrize("keep_products", [True, False])
def test_recomputed_backward_equals_the_stored_one(keep_products: bool) -> None:
    layer, (q, k, v, _, b, a) = _layer_and_inputs()
    layer.keep_products = keep_products
    upstream = torch.randn(*v.shape, generator=torch.Generator().manual_seed(1))
    inputs = (q, k, v, b, a, *layer.parameters())
    stored = gated_deltanet._mix(layer, q, k, v, b, a, None, None, 0, 1)
    want = torch.autograd.grad(stored, inputs, upstream, allow_unused=True)
    out = gated_delta_mix(layer, q, k, v, b, a)
    got = torch.autograd.grad(out, inputs, upstream, allow_unused=True)
    assert torch.equal(out, stored)
    for g, w in zip(got, want, strict=True):
        assert (g is None and w is None) or torch.equal(g, w)
