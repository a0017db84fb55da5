"""SwiGLU's ``silu(gate) * up`` in Triton: elementwise in fp32; backward recomputes the sigmoid,
so only gate and up are kept."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _forward(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    # d silu(g) / dg = s + g s (1 - s)
    tl.store(dg_ptr + offs, (dy * u * s * (1 + g * (1 - s))).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, (dy * g * s).to(du_ptr.dtype.element_ty), mask=mask)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, gate: torch.Tensor, up: torch.Tensor
    ) -> torch.Tensor:
        if gate.shape != up.shape:
            raise ValueError(f"gate {list(gate.shape)} and up {list(up.shape)} differ in shape")
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate, dtype=torch.promote_types(gate.dtype, up.dtype))
        n = y.numel()
        _forward[(triton.cdiv(n, BLOCK),)](gate, up, y, n, BLOCK=BLOCK)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = dy.numel()
        _backward[(triton.cdiv(n, BLOCK),)](dy, gate, up, dg, du, n, BLOCK=BLOCK)
        return dg, du


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for same-shaped tensors."""
    return _SwiGLU.apply(gate, up)
