"""Root-mean-square layer norm."""

import torch
from torch import nn

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
