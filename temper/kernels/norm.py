"""RMSNorm behind the kernel dispatcher, beside its plain-PyTorch reference."""

from __future__ import annotations

from collections.abc import Callable

import torch

from temper.kernels.dispatch import Impl, choose


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize in fp32, cast back to x's dtype, then scale: HF Llama's order, so bf16 outputs
    match checkpoints trained there. Backward keeps x and each row's 1/rms only (`_RMSNorm`)."""
    # x goes in twice (the second time as a view: Dynamo refuses one tensor in two places): its
    # two uses in the formula, the scaling and the square, each get their own gradient, which
    # autograd then sums into x in the order it would for the formula itself.
    return _RMSNorm.apply(x, x.view_as(x), weight, eps)


class _RMSNorm(torch.autograd.Function):
    """The formula above, whose backward is autograd's own, op for op, so gradients are
    bitwise those of the plain formula; it recomputes the normalized rows instead of keeping
    them (one [tokens, dim] tensor per norm)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        x_again: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        h = x.float()
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return weight * (h * rstd).to(x.dtype)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        x, rstd, weight = ctx.saved_tensors
        h = x.float()
        normed = (h * rstd).to(x.dtype)
        grad_weight = None
        if ctx.needs_input_grad[2]:
            grad_weight = (grad * normed).sum_to_size(weight.shape).to(weight.dtype)
        if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            return None, None, grad_weight, None
        grad_h = (grad * weight).to(x.dtype).float()
        through_scale = grad_h * rstd
        grad_rstd = (grad_h * h).sum_to_size(rstd.shape)
        grad_mean = -0.5 * grad_rstd * rstd.pow(3)
        through_square = grad_mean.expand(h.shape) / h.shape[-1] * (2.0 * h)
        if x.dtype == h.dtype:  # x.float() is x itself: autograd sums the two uses into x
            return through_scale, through_square, grad_weight, None
        return (through_scale + through_square).to(x.dtype), None, grad_weight, None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, impl: Impl | None = None
) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., dim] with weight [dim]; ``impl`` is the form
    asked for (None: the reference)."""
    return choose("rmsnorm", x.device, impl, rms_norm_reference, _triton)(x, weight, eps)


def _triton() -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
    from temper.kernels.triton.norm import rms_norm

    return rms_norm
