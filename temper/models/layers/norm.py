"""Root-mean-square layer norms: Llama's, the zero-centred (1 + w) one, and the gated one.

Each takes the forward's kernel choices (``ForwardContext.kernels``; the references when not
given), so a block calls whichever norm its family uses the same way: ``norm(x, ctx.kernels)``.
"""

import torch
import torch.nn.functional as F
from torch import nn

from temper.kernels.dispatch import REFERENCE, Kernels
from temper.kernels.norm import rms_norm


class RMSNorm(nn.Module):
    """RMSNorm that normalizes in fp32 and casts back before the weight, as HF Llama does.

    Matching HF's cast order keeps bf16 outputs bit-compatible with checkpoints trained there.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, kernels: Kernels = REFERENCE) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, kernels.rmsnorm)


class NoNorm(nn.Identity):
    """Where a family has no norm (Llama's q and k): the identity, called as the norms are."""

    def forward(self, x: torch.Tensor, kernels: Kernels = REFERENCE) -> torch.Tensor:
        return x


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaled by ``1 + weight`` (weight starts at 0), as Qwen3-Next and Qwen3.5 store
    it; the product is taken in fp32 before the cast back, their order (not Llama's)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor, kernels: Kernels = REFERENCE) -> torch.Tensor:
        """Plain PyTorch whatever ``kernels`` says: the fused RMSNorm casts before the weight,
        this norm after it."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """``RMSNorm(x) * silu(gate)`` over the last dim: Gated DeltaNet's output norm, whose gate
    ``z`` is a projection of the block input."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(
        self, x: torch.Tensor, gate: torch.Tensor, kernels: Kernels = REFERENCE
    ) -> torch.Tensor:
        normed = rms_norm(x, self.weight, self.eps, kernels.rmsnorm)
        return (normed * F.silu(gate.float())).to(x.dtype)
