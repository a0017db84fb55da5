"""The causal convolution's fast backward, and its compiled forward, against ``F.conv1d``
(the reference), in fp64."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from temper.kernels.causal_conv import causal_conv, causal_conv_reference


def _inputs(
    seed: int, seq: int, channels: int, with_window: bool
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """fp64 (x, weight[, window]) for a kernel of 4 on batch 2, and an upstream gradient."""
    gen = torch.Generator().manual_seed(seed)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)

    x, weight, window = leaf(2, seq, channels), leaf(channels, 4), leaf(2, 3, channels)
    upstream = torch.randn(2, seq, channels, generator=gen, dtype=torch.float64)
    return ((x, weight, window) if with_window else (x, weight)), upstream


@pytest.mark.parametrize("with_window", [False, True])
def test_fast_backward_equals_the_reference(with_window: bool) -> None:
    """Outputs bit-identical (eager, the same forward); gradients of the input, the weight and
    the carried window equal the reference's autograd to fp64 rounding."""
    inputs, upstream = _inputs(seed=0, seq=11, channels=6, with_window=with_window)
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
    """Compiled, the forward is the shifted multiply-adds (no convolution in the traced
    graphs): outputs and gradients equal the reference's to fp64 rounding."""
    inputs, upstream = _inputs(seed=2, seq=13, channels=5, with_window=with_window)
    want = causal_conv_reference(*inputs)
    want_grads = torch.autograd.grad(want, inputs, upstream)
    graphs: list[torch.fx.GraphModule] = []

    def record(graph: torch.fx.GraphModule, _: list[torch.Tensor]) -> Callable[..., object]:
        graphs.append(graph)
        return make_boxed_func(graph.forward)

    backend = aot_autograd(fw_compiler=record, bw_compiler=record)
    got = torch.compile(causal_conv, backend=backend, fullgraph=True)(*inputs)
    got_grads = torch.autograd.grad(got, inputs, upstream)
    targets = {node.target for graph in graphs for node in graph.graph.nodes}
    assert len(graphs) == 2 and torch.ops.aten.convolution.default not in targets
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
