"""SwiGLU's gate, ``silu(gate) * up``, behind the kernel dispatcher, beside its reference; and
the feed-forward's down projection taken together with it (``swiglu_linear``), so the product
need not be kept for backward."""

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


def swiglu_linear(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, impl: Impl | None = None
) -> torch.Tensor:
    """``F.linear(silu(gate) * up, weight)``: a SwiGLU feed-forward's down projection (no bias)
    with its input. The reference and its compiled form keep gate, up and the weight but not
    their product, a [tokens, hidden] tensor per layer; the Triton form is the Triton SwiGLU
    then ``F.linear``, which keeps it."""
    return choose("swiglu", gate.device, impl, swiglu_linear_reference, _triton_linear)(
        gate, up, weight
    )


def swiglu_linear_reference(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """``F.linear(silu(gate) * up, weight)``, recomputing the product for the weight's gradient
    (`_SwiGLULinear`). Under autocast every operand takes its dtype first, as ``F.linear``'s."""
    if not gate.is_meta and torch.is_autocast_enabled(gate.device.type):
        dtype = torch.get_autocast_dtype(gate.device.type)
        gate, up, weight = gate.to(dtype), up.to(dtype), weight.to(dtype)
    return _SwiGLULinear.apply(gate, up, weight)


class _SwiGLULinear(torch.autograd.Function):
    """The down projection of ``silu(gate) * up``. Backward computes what autograd computes
    through ``_SwiGLU`` and ``F.linear``, with the same ops (the same bits), plus the product
    once more for the weight's gradient: one pass over [tokens, hidden] bought for not keeping
    it, and three fewer fresh tensors of that size for writing over its own temporaries."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        gate: torch.Tensor,
        up: torch.Tensor,
        weight: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(gate, up, weight)
        return F.linear(_times(F.silu(gate), up), weight)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        gate, up, weight = ctx.saved_tensors
        needs_gate, needs_up, needs_weight = ctx.needs_input_grad
        silu = F.silu(gate)
        grad_gate = grad_up = grad_weight = None
        if needs_weight:
            product = silu * up
            grad_weight = grad.flatten(0, -2).mT.mm(product.flatten(0, -2))
            del product
        if needs_gate or needs_up:
            grad_product = grad.matmul(weight)
            if needs_up:
                grad_up = _times(silu, grad_product)
            if needs_gate:
                grad_gate = torch.ops.aten.silu_backward(_times(grad_product, up), gate)
        return grad_gate, grad_up, grad_weight


def _times(scratch: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``scratch * other``, written over ``scratch``, a temporary nobody else holds: on CPU a
    fresh [tokens, hidden] tensor costs page faults as well as its pass. Compiled code plans
    its own buffers (and torch 2.11 compiles these in-place products to wrong values), so
    there it is the plain product."""
    if torch.compiler.is_compiling():
        return scratch * other
    return scratch.mul_(other)


def _triton_linear() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    from temper.kernels.triton.swiglu import swiglu

    return lambda gate, up, weight: F.linear(swiglu(gate, up), weight)
