"""Gated DeltaNet's cross-token core keeps only its inputs for backward, and its recomputed
backward gives the gradients of the stored one exactly."""

from __future__ import annotations

import torch

from temper.models import build_model
from temper.models.layers import gated_deltanet
from temper.models.layers.gated_deltanet import GatedDeltaNet, gated_delta_mix


def _layer_and_inputs() -> tuple[GatedDeltaNet, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = build_model("qwen3_5_moe", "debug", device="cpu", vocab_size=64)
    layer = next(m for m in model.modules() if isinstance(m, GatedDeltaNet))
    x = torch.randn(2, 70, model.args.dim)  # two chunks of 64
    return layer, tuple(t.detach().requires_grad_() for t in layer.project(x) if t is not None)


def test_mix_saves_only_its_inputs() -> None:
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


def test_recomputed_backward_equals_the_stored_one() -> None:
    layer, (q, k, v, _, b, a) = _layer_and_inputs()
    upstream = torch.randn(*v.shape, generator=torch.Generator().manual_seed(1))
    inputs = (q, k, v, b, a, *layer.parameters())
    stored = gated_deltanet._mix(layer, q, k, v, b, a, None, None, 0, 1, None)
    want = torch.autograd.grad(stored, inputs, upstream, allow_unused=True)
    out = gated_delta_mix(layer, q, k, v, b, a)
    got = torch.autograd.grad(out, inputs, upstream, allow_unused=True)
    assert torch.equal(out, stored)
    for g, w in zip(got, want, strict=True):
        assert (g is None and w is None) or torch.equal(g, w)
