"""SwiGLU feed-forward."""

import torch
from torch import nn

from temper.kernels.swiglu import swiglu
from temper.models.layers.context import ForwardContext
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

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        """Each token alone; of the context only the kernel choices matter (None: the
        references)."""
        impl = None if ctx is None else ctx.kernels.swiglu
        return self.w2(swiglu(self.w1(x), self.w3(x), impl))
