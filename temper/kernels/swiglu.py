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
    layer. Each product is written over a temporary of its own (IEEE products commute, so
    the bits are the same), one fresh [tokens, ffn] tensor per output instead of two."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, gate: torch.Tensor, up: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gate, up = ctx.saved_tensors
        grad_gate = grad_up = None
        if ctx.needs_input_grad[0]:
            grad_gate = grad * up
            torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        if ctx.needs_input_grad[1]:
            grad_up = F.silu(gate).mul_(grad)
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor, impl: Impl | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for same-shaped tensors; ``impl`` is the form asked for (None: the
    reference). Every form keeps only gate and up for backward."""
    return choose("swiglu", gate.device, impl, swiglu_reference, _triton)(gate, up)


def _triton() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    from temper.kernels.triton.swiglu import swiglu

    return swiglu
