"""Rotary embedding application (rotate-half layout) behind the kernel dispatcher."""

from __future__ import annotations

from collections.abc import Callable

import torch

from temper.kernels.dispatch import Impl, choose


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, seq, heads, head_dim] by cos/sin [batch, seq, head_dim], which are cast
    to x's dtype first, as HF does."""
    cos = cos.to(x.dtype).unsqueeze(2)
    sin = sin.to(x.dtype).unsqueeze(2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, impl: Impl | None = None
) -> torch.Tensor:
    """``apply_rope_reference`` through the dispatcher; ``impl`` is the form asked for
    (None: the reference)."""
    return choose("rope", x.device, impl, apply_rope_reference, _triton)(x, cos, sin)


def _triton() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    from temper.kernels.triton.rope import apply_rope

    return apply_rope
