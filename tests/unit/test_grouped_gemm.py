import pytest
import torch

from temper.kernels import grouped_gemm, grouped_mm
from temper.kernels.grouped_gemm import (
    grouped_mm_fast,
    grouped_mm_op,
    grouped_mm_reference,
    grouped_mm_weight_grad,
)

# Group sizes with an empty group in the middle and one at the end.
SIZES = [3, 0, 5, 1, 7, 0]


def _operands(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(sum(SIZES), 16, dtype=dtype, requires_grad=True)
    w = torch.randn(len(SIZES), 16, 24, dtype=dtype, requires_grad=True)
    offsets = torch.tensor(SIZES).cumsum(0).to(torch.int32)
    return x, w, offsets


def test_reference_equals_per_token_matmul() -> None:
    x, w, offsets = _operands(torch.float64)
    group = torch.repeat_interleave(torch.arange(len(SIZES)), torch.tensor(SIZES))
    naive = torch.stack([x[t] @ w[g] for t, g in enumerate(group.tolist())])
    torch.testing.assert_close(grouped_mm_reference(x, w, offsets), naive, rtol=1e-12, atol=0)


def test_reference_accepts_transposed_weights_and_no_tokens() -> None:
    x, w, offsets = _operands(torch.float32)
    w_out_in = w.detach().mT.contiguous()  # [G, N, K], nn.Linear's layout, as experts hold it
    torch.testing.assert_close(grouped_mm(x, w_out_in.mT, offsets), grouped_mm(x, w, offsets))
    empty = grouped_mm(x[:0], w, torch.zeros(len(SIZES), dtype=torch.int32))
    assert empty.shape == (0, 24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_grouped_mm_equals_reference_forward_and_backward(dtype: torch.dtype) -> None:
    x, w, offsets = _operands(dtype)
    expected = grouped_mm_reference(x, w, offsets)
    (x_grad, w_grad) = torch.autograd.grad(expected.sum(), (x, w))
    got = grouped_mm_fast(x, w.mT.contiguous().mT, offsets)  # column-major, as experts pass it
    assert not got._is_view()  # an FSDP2-wrapped module's view output loses its backward hook
    # .sum() hands backward an expanded gradient, which torch._grouped_mm alone rejects.
    (x_fast, w_fast) = torch.autograd.grad(got.sum(), (x, w))
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    torch.testing.assert_close(got, expected, **tol)
    torch.testing.assert_close(x_fast, x_grad, **tol)
    torch.testing.assert_close(w_fast, w_grad, **tol)


def test_autocast_computes_in_its_dtype() -> None:
    x, w, offsets = _operands(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = grouped_mm(x, w, offsets)
    assert out.dtype == torch.bfloat16
    expected = grouped_mm_reference(x.bfloat16(), w.bfloat16(), offsets)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("fast", [True, False], ids=["dispatch", "loop"])
def test_the_custom_op_and_its_gradients_equal_the_loop_with_empty_groups(
    fast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``temper::grouped_mm`` (the fast path where it fits, or forced onto the loop) against the
    reference loop's autograd, in fp32: output, rows' and weights' gradients; an empty group's
    weights get exactly zero gradient."""
    if not fast:
        monkeypatch.setattr(grouped_gemm, "_fast_path_fits", lambda *_: False)
    x, w, offsets = _operands(torch.float32)
    w_col = w.mT.contiguous().mT.detach().requires_grad_()  # column-major, as experts pass it
    grad = torch.randn(len(x), 24)
    expected = grouped_mm_reference(x, w_col, offsets)
    expected_grads = torch.autograd.grad(expected, (x, w_col), grad)
    got = grouped_mm_op(x, w_col, offsets)
    got_grads = torch.autograd.grad(got, (x, w_col), grad)
    tol = {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(got, expected, **tol)
    for g, e in zip(got_grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, **tol)
    empty = [i for i, n in enumerate(SIZES) if n == 0]
    assert torch.equal(got_grads[1][empty], torch.zeros_like(got_grads[1][empty]))


def test_opcheck_the_custom_ops() -> None:
    """Schema, fake (shape) rule, autograd registration and AOT dispatch, as torch checks them."""
    x, w, offsets = _operands(torch.float32)
    torch.library.opcheck(grouped_mm_op, (x, w, offsets))
    torch.library.opcheck(grouped_mm_op, (x.detach().double(), w.detach().double(), offsets))
    torch.library.opcheck(grouped_mm_weight_grad, (x.detach(), torch.randn(len(x), 24), offsets))


def test_compiles_to_one_graph_with_the_custom_op() -> None:
    """fullgraph=True (a graph break would raise) holds one opaque op, not the loop; the
    compiled forward and backward equal the loop's, also for new group sizes of the same
    shape, without recompiling."""
    graphs = []

    def backend(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(graph)
        return graph.forward

    torch.compiler.reset()
    compiled = torch.compile(grouped_mm, backend=backend, fullgraph=True, dynamic=False)
    x, w, offsets = _operands(torch.float32)
    for offs in (offsets, torch.tensor([16, 16, 16, 16, 16, 16], dtype=torch.int32)):
        expected = grouped_mm_reference(x, w, offs)
        got = compiled(x, w, offs)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        grads = torch.autograd.grad(got.sum(), (x, w))
        for g, e in zip(grads, torch.autograd.grad(expected.sum(), (x, w)), strict=True):
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
    assert len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.temper.grouped_mm.default in targets
    torch.compiler.reset()


@pytest.mark.parametrize(("mode", "runs"), [("selective", 9), ("full", 12)])
def test_selective_checkpointing_saves_the_custom_ops_output(
    mode: str, runs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Experts' three GEMMs: forward 3 runs, backward 6 (rows' and weights' gradients);
    `full` runs the 3 forward ones again, `selective` keeps their outputs."""
    from temper.models.layers.experts import GroupedExperts
    from temper.parallel.activation_checkpoint import apply_activation_checkpointing

    calls = []
    fits = grouped_gemm._fast_path_fits
    monkeypatch.setattr(grouped_gemm, "_fast_path_fits", lambda *a: calls.append(1) or fits(*a))
    torch.manual_seed(0)
    experts = GroupedExperts(16, 24, len(SIZES))
    experts.init_weights(std=0.5, out_std=0.5)
    x, _, offsets = _operands(torch.float32)
    apply_activation_checkpointing([experts], mode)
    experts(x, offsets).sum().backward()
    assert len(calls) == runs
