import pytest
import torch

from temper.kernels import grouped_gemm, grouped_mm
from temper.kernels.grouped_gemm import _cpu_kernel_exists, grouped_mm_fast, grouped_mm_reference

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


@pytest.mark.skipif(not _cpu_kernel_exists(torch.float32), reason="no CPU torch._grouped_mm")
def test_cpu_fp32_takes_torch_grouped_mm_eagerly_and_the_loop_under_compile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []

    def counted(*args: torch.Tensor) -> torch.Tensor:
        calls.append(torch.compiler.is_compiling())
        return grouped_mm_fast(*args)

    monkeypatch.setattr(grouped_gemm, "grouped_mm_fast", counted)
    x, w, offsets = _operands(torch.float32)
    expected = grouped_mm_reference(x, w, offsets)
    torch.testing.assert_close(grouped_mm(x, w, offsets), expected, rtol=1e-5, atol=1e-5)
    assert calls == [False]
    # torch.compile's shape rule for the op takes bf16 only: the fp32 graph holds the loop.
    compiled = torch.compile(grouped_mm, backend="eager", fullgraph=False)
    torch.testing.assert_close(compiled(x, w, offsets), expected, rtol=1e-5, atol=1e-5)
    assert calls == [False]
