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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _Rope(torch.autograd.Function):
    """Autograd through the formula keeps x and the rotated copy of x for every q and k; the
    rotation is linear, so its backward is the inverse rotation of the gradient and needs
    neither."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return x * cos + _rotate_half(x) * sin

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        # rotate_half's transpose is -rotate_half: (g1, g2) -> (g2, -g1).
        return grad * cos - _rotate_half(grad * sin), None, None


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, impl: Impl | None = None
) -> torch.Tensor:
    """``apply_rope_reference`` through the dispatcher; ``impl`` is the form asked for
    (None: the reference)."""
    return choose("rope", x.device, impl, apply_rope_reference, _triton)(x, cos, sin)


def _triton() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    from temper.kernels.triton.rope import apply_rope

    return apply_rope
