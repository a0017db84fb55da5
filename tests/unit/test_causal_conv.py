"""The causal convolution's fast backward, and its compiled forward, against ``F.conv1d``
(the reference), in fp64."""

from __future__ import annotations

import pytest
import torch

from temper.kernels.causal_conv import causal_conv, causal_conv_reference


@pytest.mark.parametrize("with_window", [False, True])
def test_fast_backward_equals_the_reference(with_window: bool) -> None:
    """Outputs bit-identical (eager, the same forward); gradients of the input, the weight and
    the carried window equal the reference's autograd to fp64 rounding."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 11, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    window = torch.randn(2, 3, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 11, 6, generator=gen, dtype=torch.float64)
    inputs = (x, weight, window) if with_window else (x, weight)
    results = []
    for conv in (causal_conv_reference, causal_conv):
        out = conv(*inputs)
        results.append((out, torch.autograd.grad(out, inputs, upstream)))
    (want, want_grads), (got, got_grads) = results
    assert torch.equal(got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_fast_backward_passes_gradcheck() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 7, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(causal_conv, (x, weight))


@pytest.mark.parametrize("with_window", [False, True])
def test_compiled_shifted_sums_equal_the_reference(with_window: bool) -> None:
    """Compiled, the forward is the shifted multiply-adds: outputs and gradients equal the
    reference's to fp64 rounding."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 13, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    window = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 13, 5, generator=gen, dtype=torch.float64)
    inputs = (x, weight, window) if with_window else (x, weight)
    want = causal_conv_reference(*inputs)
    want_grads = torch.autograd.grad(want, inputs, upstream)
    got = torch.compile(causal_conv, fullgraph=True)(*inputs)
    got_grads = torch.autograd.grad(got, inputs, upstream)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
