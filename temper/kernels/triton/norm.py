"""RMSNorm in Triton: one program per row forward; a strip of rows per program backward, each
accumulating its weight-gradient partial in registers (summed in torch: no atomics)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from temper.kernels.triton import num_warps, program_count


@triton.jit
def _forward(x_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    # HF's order: normalized value rounded to x's dtype, then times the weight.
    xhat = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, (w * xhat).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _backward(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, n_rows, n_cols, rows_per_program,
    BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, n_rows)
    for row in range(start, end):
        offs = tl.cast(row, tl.int64) * n_cols + cols
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = x.to(tl.float32) * rstd
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / n_cols))
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat.to(x.dtype).to(tl.float32)
    tl.store(dw_ptr + pid * n_cols + cols, dw, mask=mask)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        rows, cols = x2.shape
        y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(cols)
        weight = weight.contiguous()
        _forward[(rows,)](x2, weight, y, rstd, cols, eps, BLOCK=block, num_warps=num_warps(block))
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(shape)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        x2, weight, rstd = ctx.saved_tensors
        rows, cols = x2.shape
        dy2 = dy.reshape(rows, cols).contiguous()
        dx = torch.empty_like(x2)
        programs = max(1, min(rows, program_count(x2.device)))
        per_program = triton.cdiv(rows, programs)
        dw = torch.empty(programs, cols, dtype=torch.float32, device=x2.device)
        block = triton.next_power_of_2(cols)
        _backward[(programs,)](
            dy2, x2, weight, rstd, dx, dw, rows, cols, per_program,
            BLOCK=block, num_warps=num_warps(block),
        )  # fmt: skip
        return dx.view(dy.shape), dw.sum(0).to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; saves x and one fp32 rstd per row for backward."""
    return _RMSNorm.apply(x, weight, eps)
