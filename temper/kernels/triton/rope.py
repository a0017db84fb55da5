"""Rotary embedding in Triton: one program per token rotates all its heads, reading that
token's cos/sin once. The backward is the transposed rotation, so nothing but cos and sin is
kept."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(
    x_ptr, cos_ptr, sin_ptr, y_ptr, seq_len, n_heads, head_dim, cs_stride_b, cs_stride_s,
    BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    half = head_dim // 2
    d = tl.arange(0, BLOCK_D)
    heads = tl.arange(0, BLOCK_H)
    d_mask = d < half
    mask = (heads[:, None] < n_heads) & d_mask[None, :]
    cs = (token // seq_len) * cs_stride_b + (token % seq_len) * cs_stride_s
    offs = token * n_heads * head_dim + heads[:, None] * head_dim + d[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    x1 = x.to(tl.float32)
    x2 = tl.load(x_ptr + offs + half, mask=mask, other=0.0).to(tl.float32)
    # cos and sin are rounded to x's dtype first, as HF does.
    c1 = tl.load(cos_ptr + cs + d, mask=d_mask, other=0.0).to(x.dtype).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + cs + half + d, mask=d_mask, other=0.0).to(x.dtype).to(tl.float32)
    s1 = tl.load(sin_ptr + cs + d, mask=d_mask, other=0.0).to(x.dtype).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + cs + half + d, mask=d_mask, other=0.0).to(x.dtype).to(tl.float32)
    c2, s2 = c2[None, :], s2[None, :]
    # forward: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2; backward is its transpose.
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(y_ptr + offs, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + offs + half, y2.to(y_ptr.dtype.element_ty), mask=mask)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    b, s, h, d = x.shape
    x = x.contiguous()
    cos, sin = (t.contiguous().expand(b, s, d) for t in (cos, sin))
    y = torch.empty_like(x)
    _rotate[(b * s,)](
        x, cos, sin, y, s, h, d, cos.stride(0), cos.stride(1),
        BACKWARD=backward,
        BLOCK_H=triton.next_power_of_2(h),
        BLOCK_D=triton.next_power_of_2(d // 2),
    )  # fmt: skip
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _apply(x, cos, sin, backward=False)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor
    ) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _apply(dy, cos, sin, backward=True), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, seq, heads, head_dim] (rotate-half layout) by cos/sin [1 or batch, seq,
    head_dim]; cos and sin carry no gradient."""
    return _Rope.apply(x, cos, sin)
