"""MoE token movement in Triton, as gathers only: every output row is written by one program,
so there are no atomics and results are bitwise repeatable.

With ``pos`` the inverse of ``order`` (row of each (token, slot)): permute gathers
``x[order // k]`` and its backward sums each token's k row gradients at ``pos``; unpermute
sums ``w * y[pos]`` per token, its backward gathers ``w * grad[order // k]`` for the rows and
one dot product per (token, slot) for the weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from temper.kernels.moe_permute import rows_of


@triton.jit
def _gather_rows(
    src_ptr, index_ptr, scale_ptr, out_ptr, dim, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr
):
    """out[i] = scale[i] * src[index[i]]."""
    row = tl.program_id(0).to(tl.int64)
    src_row = tl.load(index_ptr + row).to(tl.int64)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + row).to(tl.float32)
    for start in range(0, dim, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < dim
        v = tl.load(src_ptr + src_row * dim + cols, mask=mask, other=0.0)
        if HAS_SCALE:
            v = v.to(tl.float32) * scale
        tl.store(out_ptr + row * dim + cols, v.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gather_sum(
    src_ptr, index_ptr, weight_ptr, out_ptr, dim, top_k,
    HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """out[t] = sum_j weight[t, j] * src[index[t, j]], accumulated in fp32."""
    token = tl.program_id(0).to(tl.int64)
    for start in range(0, dim, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < dim
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in range(top_k):
            src_row = tl.load(index_ptr + token * top_k + j).to(tl.int64)
            v = tl.load(src_ptr + src_row * dim + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_WEIGHT:
                v = v * tl.load(weight_ptr + token * top_k + j).to(tl.float32)
            acc += v
        tl.store(out_ptr + token * dim + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gather_dot(g_ptr, y_ptr, index_ptr, out_ptr, dim, top_k, BLOCK: tl.constexpr):
    """out[t, j] = <g[t], y[index[t, j]]>."""
    slot = tl.program_id(0).to(tl.int64)
    token = slot // top_k
    src_row = tl.load(index_ptr + slot).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, dim, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < dim
        g = tl.load(g_ptr + token * dim + cols, mask=mask, other=0.0).to(tl.float32)
        acc += g * tl.load(y_ptr + src_row * dim + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + slot, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty))


def _block(dim: int) -> int:
    return min(triton.next_power_of_2(dim), 1024)


def _rows(src: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    out = src.new_empty(index.numel(), src.shape[1])
    has_scale = scale is not None
    _gather_rows[(index.numel(),)](
        src, index, scale if has_scale else src, out, src.shape[1],
        HAS_SCALE=has_scale, BLOCK=_block(src.shape[1]),
    )  # fmt: skip
    return out


def _sums(src: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    n, k = index.shape
    out = src.new_empty(n, src.shape[1])
    has_weight = weights is not None
    _gather_sum[(n,)](
        src, index, weights if has_weight else src, out, src.shape[1], k,
        HAS_WEIGHT=has_weight, BLOCK=_block(src.shape[1]),
    )  # fmt: skip
    return out


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, order: torch.Tensor, top_k: int
    ) -> torch.Tensor:
        ctx.save_for_backward(order)
        ctx.top_k = top_k
        return _rows(x.contiguous(), order // top_k, None)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_rows: torch.Tensor
    ) -> tuple[torch.Tensor, None, None]:
        (order,) = ctx.saved_tensors
        pos = rows_of(order).view(-1, ctx.top_k)
        return _sums(grad_rows.contiguous(), pos, None), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        y: torch.Tensor,
        order: torch.Tensor,
        weights: torch.Tensor,
    ) -> torch.Tensor:
        y, weights = y.contiguous(), weights.contiguous()
        pos = rows_of(order).view(weights.shape)
        ctx.save_for_backward(y, order, pos, weights)
        return _sums(y, pos, weights)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, torch.Tensor | None]:
        y, order, pos, weights = ctx.saved_tensors
        grad = grad.contiguous()
        k = weights.shape[1]
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_y = _rows(grad, order // k, weights.flatten()[order])
        if ctx.needs_input_grad[2]:
            grad_w = torch.empty_like(weights)
            dim = y.shape[1]
            _gather_dot[(pos.numel(),)](grad, y, pos, grad_w, dim, k, BLOCK=_block(dim))
        return grad_y, None, grad_w


def permute(x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """x [n, dim] -> rows [n * top_k, dim], row i being token ``order[i] // top_k``."""
    return _Permute.apply(x, order, top_k)


def unpermute(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Rows [n * k, dim] -> [n, dim]: each token's sum of its k rows times ``weights`` [n, k]."""
    return _Unpermute.apply(y, order, weights)
