"""Rotary embedding application (rotate-half layout) behind the kernel dispatcher."""

from __future__ import annotations

from collections.abc import Callable

import torch

from temper.kernels.dispatch import Impl, choose


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, seq, heads, head_dim] by cos/sin [batch, seq, head_dim], which are cast
    to x's dtype first, as HF does. Backward keeps only cos and sin (`_Rope`); the tables get
    no gradient."""
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("apply_rope: cos and sin are fixed tables and must not require grad")
    return _Rope.apply(x, cos.to(x.dtype).unsqueeze(2), sin.to(x.dtype).unsqueeze(2))


class _Rope(torch.autograd.Function):
    """Autograd through ``x * cos + rotate_half(x) * sin`` keeps x and the rotated copy of x
    for every q and k; the rotation is linear, so its backward is the inverse rotation of the
    gradient and needs neither. Both directions write the halves in place, without the
    concatenated copy: each element is the same two products and one sum, so the same bits."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        x1, x2 = x.chunk(2, dim=-1)
        sin1, sin2 = sin.chunk(2, dim=-1)
        out = x * cos
        out1, out2 = out.chunk(2, dim=-1)
        out1.sub_(x2 * sin1)  # rotate_half(x) = (-x2, x1)
        out2.add_(x1 * sin2)
        return out

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        # rotate_half's transpose maps (g1, g2) to (g2, -g1).
        rotated1, rotated2 = (grad * sin).chunk(2, dim=-1)
        grad_x = grad * cos
        grad1, grad2 = grad_x.chunk(2, dim=-1)
        grad1.add_(rotated2)
        grad2.sub_(rotated1)
        return grad_x, None, None


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, impl: Impl | None = None
) -> torch.Tensor:
    """``apply_rope_reference`` through the dispatcher; ``impl`` is the form asked for
    (None: the reference)."""
    return choose("rope", x.device, impl, apply_rope_reference, _triton)(x, cos, sin)


def _triton() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    from temper.kernels.triton.rope import apply_rope

    return apply_rope
