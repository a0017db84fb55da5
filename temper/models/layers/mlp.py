"""SwiGLU feed-forward."""

import torch
from torch import nn

from temper.kernels.swiglu import swiglu
from temper.models.layers.init import init_linear


class FeedForward(nn.Module):
    """``w2(silu(w1 x) * w3 x)``: w1 is HF's gate_proj, w3 up_proj, w2 down_proj."""

    def __init__(self, dim: int, hidden_dim: int, bias: bool = False) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.w2 = nn.Linear(hidden_dim, dim, bias=bias)
        self.w3 = nn.Linear(dim, hidden_dim, bias=bias)

    def init_weights(self, std: float, out_std: float) -> None:
        """``out_std`` is for ``w2``, which writes into the residual stream."""
        init_linear(self.w1, std)
        init_linear(self.w3, std)
        init_linear(self.w2, out_std)

    def forward(self, x: torch.Tensor, valid_len: int | None = None) -> torch.Tensor:
        """``valid_len`` (real tokens per row, as every block feed-forward takes it) changes
        nothing here: each token is computed alone, padding or not."""
        return self.w2(swiglu(self.w1(x), self.w3(x)))
