"""RMSNorm behind the kernel dispatcher, beside its plain-PyTorch reference."""

from __future__ import annotations

from collections.abc import Callable

import torch

from temper.kernels.dispatch import Impl, choose


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize in fp32, cast back to x's dtype, then scale: HF Llama's order, so bf16 outputs
    match checkpoints trained there."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, impl: Impl | None = None
) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., dim] with weight [dim]; ``impl`` is the form
    asked for (None: the reference)."""
    return choose("rmsnorm", x.device, impl, rms_norm_reference, _triton)(x, weight, eps)


def _triton() -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
    from temper.kernels.triton.norm import rms_norm

    return rms_norm
