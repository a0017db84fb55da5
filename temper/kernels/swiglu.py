"""SwiGLU's gate, ``silu(gate) * up``, behind the kernel dispatcher, beside its reference."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from temper.kernels.dispatch import Impl, choose


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``; backward keeps gate and up only and recomputes the sigmoid, where
    autograd would also keep ``silu(gate)``, a [tokens, ffn] tensor per layer."""
    return _SwiGLU.apply(gate, up)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, gate: torch.Tensor, up: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        silu = gate * sig
        grad_up = grad * silu
        # d silu / d gate = sig * (1 + gate * (1 - sig)) = sig + silu * (1 - sig).
        grad_gate = (1 - sig).mul_(silu).add_(sig).mul_(up).mul_(grad)
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor, impl: Impl | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for same-shaped tensors; ``impl`` is the form asked for (None: the
    reference). Every form keeps only gate and up for backward."""
    return choose("swiglu", gate.device, impl, swiglu_reference, _triton)(gate, up)


def _triton() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    from temper.kernels.triton.swiglu import swiglu

    return swiglu
