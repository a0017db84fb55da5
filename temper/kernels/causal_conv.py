"""Gated DeltaNet's causal depthwise convolution with SiLU: out[t] = silu(sum_i w[:, i] *
x[t - kernel + 1 + i]), zeros (or an earlier call's last inputs) before the start.

``causal_conv_reference`` is ``F.conv1d`` with ``groups=channels``, the textbook form (and
transformers' fallback). ``causal_conv`` computes the same inside an autograd Function whose
backward is ``kernel`` shifted multiply-adds: depthwise ``conv1d`` on CPU is slow (its
backward about a tenth of a Gated DeltaNet layer's step at the benchmark's shape). Its
forward is ``F.conv1d``'s when eager, so outputs are bit-identical to the reference's, and
the shifted sums when compiled, where Inductor fuses them with the SiLU and the layout change
around them (``conv1d`` would be an opaque call); the two differ by rounding only. The
Function saves only its inputs and recomputes the pre-activation in backward, so the layer
keeps one [b, s, channels] tensor for the convolution instead of two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv_reference(
    x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None = None
) -> torch.Tensor:
    """silu(depthwise causal convolution) of x [b, s, c] with weight [c, kernel]: output t sees
    inputs t - kernel + 1 .. t, zeros before the start, or ``window`` [b, kernel - 1, c]."""
    c, kernel = weight.shape
    w = weight[:, None].to(x.dtype)
    if window is None:
        out = F.conv1d(x.transpose(1, 2), w, padding=kernel - 1, groups=c)[..., : x.shape[1]]
    else:
        out = F.conv1d(torch.cat([window.to(x.dtype), x], dim=1).transpose(1, 2), w, groups=c)
    return F.silu(out).transpose(1, 2).contiguous()


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None = None
) -> torch.Tensor:
    """``causal_conv_reference`` (same arguments and outputs) with the fast backward."""
    return _CausalConv.apply(x, weight, window)


def _shifted_sum(padded: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum_i padded[:, t + i] * weight[:, i] for t < padded.shape[1] - kernel + 1. The taps
    are copied to [kernel, channels] so that each is contiguous: read in place with stride
    ``kernel``, compiled loops over channels were not vectorized."""
    kernel = weight.shape[1]
    s = padded.shape[1] - kernel + 1
    taps = weight.t().contiguous()
    out = padded[:, :s] * taps[0]
    for i in range(1, kernel):
        out = out.addcmul_(padded[:, i : i + s], taps[i])
    return out


class _CausalConv(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        window: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.has_window = window is not None
        if window is None:
            before = x.new_zeros(x.shape[0], weight.shape[1] - 1, x.shape[2])
        else:
            before = window.to(x.dtype)
        ctx.save_for_backward(x, weight, before)
        if not torch.compiler.is_compiling():
            return causal_conv_reference(x, weight, window)
        return F.silu(_shifted_sum(torch.cat([before, x], dim=1), weight.to(x.dtype)))

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        x, weight, window = ctx.saved_tensors
        w = weight.to(x.dtype)
        kernel = w.shape[1]
        padded = torch.cat([window, x], dim=1)
        grad_pre = torch.ops.aten.silu_backward(grad, _shifted_sum(padded, w))
        # Input t' received w[:, i] * x[t'] in output t' - i: the sum over i of the gradient
        # shifted back, i.e. the same shifted sum over the gradient padded on the right with
        # the weight's taps reversed.
        grad_padded = _shifted_sum(F.pad(grad_pre, (0, 0, kernel - 1, kernel - 1)), w.flip(1))
        s = x.shape[1]
        grad_w = torch.stack(
            [(grad_pre * padded[:, i : i + s]).sum((0, 1)) for i in range(kernel)], dim=1
        )
        grad_window = grad_padded[:, : kernel - 1] if ctx.has_window else None
        return grad_padded[:, kernel - 1 :], grad_w.to(weight.dtype), grad_window
