"""The lean references against the plain formulas they replace: RMSNorm and SwiGLU (autograd's
backward op for op, keeping less) bit for bit in every gradient; RoPE's hand-written backward and
in-place halves in float64 and its fp32 and bf16 forwards bit for bit; the in-place cross-entropy
chunk gradient, and the training loss's chunk that takes statistics and gradient in one pass; the
SwiGLU with its down projection, which does not keep their product."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from temper.kernels.cross_entropy import (
    log_probs_from_logits,
    logits_grad_reference,
    loss_and_grad_reference,
)
from temper.kernels.norm import rms_norm_reference
from temper.kernels.rope import apply_rope_reference
from temper.kernels.swiglu import swiglu_linear, swiglu_reference


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("residual", [False, True], ids=["alone", "residual"])
@pytest.mark.parametrize(
    "dtype,weight_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
)
@pytest.mark.parametrize("shape", [(3, 130, 512), (2, 7, 100), (2, 9, 4, 24)])
def test_rms_norm_gradients_are_the_formulas_bit_for_bit(
    shape: tuple[int, ...], dtype: torch.dtype, weight_dtype: torch.dtype, residual: bool
) -> None:
    """Every gradient equal to autograd's through the formula, also where x feeds a residual
    branch too (autograd then sums three gradients into x, and the order of those sums shows in
    the last bit), and for per-head norms ([b, s, heads, head_dim])."""
    results = []
    for norm in (rms_norm_reference, naive_rms_norm):
        g = torch.Generator().manual_seed(0)
        leaf = torch.randn(shape, generator=g).requires_grad_()
        weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(weight_dtype)
        weight.requires_grad_()
        x = (leaf * 1.5).to(dtype)
        out = norm(x, weight, 1e-6)
        if residual:
            out = x + 0.7 * out + x.sin()
        out.backward(torch.randn(out.shape, generator=g).to(out.dtype))
        results.append((out.detach(), leaf.grad, weight.grad))
    for lean, naive in zip(*results, strict=True):
        assert torch.equal(lean, naive)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_gradients_are_the_formulas_bit_for_bit(dtype: torch.dtype) -> None:
    results = []
    for swiglu in (swiglu_reference, lambda gate, up: F.silu(gate) * up):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, 33, 64, generator=g).requires_grad_()
        w1, w3 = torch.randn(2, 64, 150, generator=g).div(8).to(dtype).unbind()
        out = swiglu(x.to(dtype) @ w1, x.to(dtype) @ w3)
        out.backward(torch.randn(out.shape, generator=g).to(dtype))
        results.append((out.detach(), x.grad))
    for lean, naive in zip(*results, strict=True):
        assert torch.equal(lean, naive)


def _feed_forward_grads(
    down: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    dtype: torch.dtype,
    autocast: bool = False,
) -> tuple[list[torch.Tensor], int]:
    """Output and gradients (input, w1, w3, w2) of ``down(x w1, x w3, w2)`` under a random
    cotangent, and the bytes of the tensors autograd saved for backward, leaves apart."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 33, 64, generator=g).requires_grad_()
    w1, w3 = (torch.randn(150, 64, generator=g).div(8).to(dtype).requires_grad_() for _ in "13")
    w2 = torch.randn(64, 150, generator=g).div(12).to(dtype).requires_grad_()
    leaves = {t.untyped_storage().data_ptr() for t in (x, w1, w3, w2)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in leaves:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", torch.bfloat16, enabled=autocast),
    ):
        h = x.to(dtype)
        out = down(F.linear(h, w1), F.linear(h, w3), w2)
    out.backward(torch.randn(out.shape, generator=g).to(out.dtype))
    return [out.detach(), x.grad, w1.grad, w3.grad, w2.grad], sum(saved.values())


@pytest.mark.parametrize(
    "dtype,autocast",
    [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
    ids=["fp32", "bf16", "autocast"],
)
def test_swiglu_linear_is_the_module_path_bit_for_bit_without_the_product(
    dtype: torch.dtype, autocast: bool
) -> None:
    """``swiglu_linear`` against ``F.linear(swiglu(gate, up), w2)``: every gradient equal, and
    autograd keeps exactly one [tokens, hidden] product fewer."""
    fused, fused_bytes = _feed_forward_grads(swiglu_linear, dtype, autocast)
    plain, plain_bytes = _feed_forward_grads(
        lambda gate, up, w2: F.linear(swiglu_reference(gate, up), w2), dtype, autocast
    )
    for got, want in zip(fused, plain, strict=True):
        assert got.dtype == want.dtype
        assert torch.equal(got, want)
    compute = torch.bfloat16 if autocast else dtype
    assert plain_bytes - fused_bytes == 2 * 33 * 150 * compute.itemsize


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("z_loss_weight", [0.0, 1e-2])
def test_loss_chunk_gives_the_statistics_bit_for_bit_and_autograds_gradient(
    dtype: torch.dtype, z_loss_weight: float
) -> None:
    """The training loss's one-pass chunk: log p(label) and lse equal to the separate statistics
    bit for bit (so the loss itself is unchanged), and over the chunk the gradient autograd
    gives for ``-sum log p + z * sum lse^2`` on valid labels (an ignored label's row is 0)."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 50, generator=g) * 3).to(dtype)
    labels = torch.tensor([3, 0, -100, 49, 7, 3])
    want_log_probs, want_lse = log_probs_from_logits(logits, labels)
    leaf = logits.float().requires_grad_()
    log_probs, lse = log_probs_from_logits(leaf, labels)
    valid = labels != -100
    (-log_probs.sum() + z_loss_weight * torch.where(valid, lse, 0.0).pow(2).sum()).backward()

    chunk = logits.clone()
    got_log_probs, got_lse, grad = loss_and_grad_reference(chunk, labels, z_loss_weight)
    assert torch.equal(got_log_probs, want_log_probs) and torch.equal(got_lse, want_lse)
    assert grad.data_ptr() == chunk.data_ptr() and grad.dtype == dtype
    assert not grad[2].any()
    if dtype == torch.float32:
        torch.testing.assert_close(grad, leaf.grad, rtol=0, atol=1e-6)
    else:  # one bf16 rounding of the fp32 gradient
        torch.testing.assert_close(grad, leaf.grad.bfloat16(), rtol=0, atol=2**-8)
