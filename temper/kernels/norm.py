"""RMSNorm behind the kernel dispatcher, beside its plain-PyTorch reference."""

from __future__ import annotations

from collections.abc import Callable

import torch

from temper.kernels.dispatch import Impl, choose


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize in fp32, cast back to x's dtype, then scale: HF Llama's order, so bf16 outputs
    match checkpoints trained there. Backward keeps only x and each row's 1/rms (`_RMSNorm`)."""
    return _RMSNorm.apply(x, weight, eps)


class _RMSNorm(torch.autograd.Function):
    """The formula above with a hand-written backward: autograd through it would keep an fp32
    copy of x and the normalized rows as well, a [tokens, dim] tensor or two per norm."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        h = x.float()
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (h * rstd).to(x.dtype)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            scaled = grad * normed.to(x.dtype)
            grad_weight = scaled.sum_to_size(weight.shape).to(weight.dtype)
        # y = n * w with n = h * rstd: dh = rstd * (dn - n * mean(dn * n)).
        grad_normed = (grad * weight).float()
        mean = (grad_normed * normed).mean(-1, keepdim=True)
        grad_x = grad_normed.sub_(normed.mul_(mean)).mul_(rstd).to(x.dtype)
        return grad_x, grad_weight, None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, impl: Impl | None = None
) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., dim] with weight [dim]; ``impl`` is the form
    asked for (None: the reference)."""
    return choose("rmsnorm", x.device, impl, rms_norm_reference, _triton)(x, weight, eps)


def _triton() -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
    from temper.kernels.triton.norm import rms_norm

    return rms_norm
