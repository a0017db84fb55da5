"""SwiGLU's gate, ``silu(gate) * up``, behind the kernel dispatcher, beside its reference."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from temper.kernels.dispatch import Impl, choose


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``; backward keeps gate and up only (`_SwiGLU`)."""
    return _SwiGLU.apply(gate, up)


class _SwiGLU(torch.autograd.Function):
    """The formula above, whose backward is autograd's own, op for op (bitwise the same
    gradients), recomputing ``silu(gate)`` instead of keeping it: a [tokens, ffn] tensor per
    layer."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, gate: torch.Tensor, up: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gate, up = ctx.saved_tensors
        grad_gate = grad_up = None
        if ctx.needs_input_grad[0]:
            grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        if ctx.needs_input_grad[1]:
            grad_up = grad * F.silu(gate)
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor, impl: Impl | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for same-shaped tensors; ``impl`` is the form asked for (None: the
    reference). Every form keeps only gate and up for backward."""
    return choose("swiglu", gate.device, impl, swiglu_reference, _triton)(gate, up)


def _triton() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    from temper.kernels.triton.swiglu import swiglu

    return swiglu
