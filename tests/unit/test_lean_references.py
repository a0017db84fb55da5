"""The lean references (RoPE's hand-written backward and in-place halves, the in-place
cross-entropy chunk gradient) against the plain formulas they replace: float64 forward and every
gradient, fp32 and bf16 forwards bit for bit."""

from __future__ import annotations

import pytest
import torch

from temper.kernels.cross_entropy import logits_grad_reference
from temper.kernels.rope import apply_rope_reference


def naive_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos = cos.to(x.dtype).unsqueeze(2)
    sin = sin.to(x.dtype).unsqueeze(2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _cases() -> list[tuple]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 8, generator=g)
    angles = torch.randn(2, 5, 8, generator=g)
    return [(apply_rope_reference, naive_rope, (x, angles.cos(), angles.sin()), (0,), 1e-12)]


@pytest.mark.parametrize("case", _cases(), ids=["rope"])
def test_lean_reference_matches_autograd_formula(case: tuple) -> None:
    lean, naive, args, differentiable, tol = case
    outputs, grads = [], []
    for fn in (lean, naive):
        inputs = [
            a.double().requires_grad_(i in differentiable) if isinstance(a, torch.Tensor) else a
            for i, a in enumerate(args)
        ]
        out = fn(*inputs)
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out))
        outputs.append(out.detach())
        grads.append([inputs[i].grad for i in differentiable])
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-12, atol=1e-12)
    for got, want in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # fp32 and bf16 forwards: the same operations in the same order, so the same bits.
    assert torch.equal(lean(*args), naive(*args))
    bf16 = [a.bfloat16() if isinstance(a, torch.Tensor) and a.dim() > 1 else a for a in args]
    assert torch.equal(lean(*bf16), naive(*bf16))


def test_rope_refuses_tables_that_require_grad() -> None:
    x, t = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 4, requires_grad=True)
    with pytest.raises(ValueError, match="cos and sin"):
        apply_rope_reference(x, t, t.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_grad_in_place_equals_out_of_place_formula(dtype: torch.dtype) -> None:
    """The in-place chunk gradient against the out-of-place formula it replaced: equal values,
    written over the chunk itself; an ignored label (-100) adds nothing."""
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(6, 50, generator=g) * 3).to(dtype)
    labels = torch.tensor([3, 0, -100, 49, 7, 3])
    lse = logits.float().logsumexp(-1)
    grad_log_probs = torch.where(labels != -100, -torch.rand(6, generator=g), 0.0)
    grad_lse = torch.randn(6, generator=g)
    probs = (logits.float() - lse[:, None]).exp()
    onehot = torch.arange(50) == labels.clamp(min=0)[:, None]
    grad = probs * (grad_lse - grad_log_probs)[:, None]
    want = (grad + torch.where(onehot, grad_log_probs[:, None], 0.0)).to(dtype)
    chunk = logits.clone()
    got = logits_grad_reference(chunk, labels, lse, grad_log_probs, grad_lse)
    assert got.data_ptr() == chunk.data_ptr()
    assert torch.equal(got, want)
