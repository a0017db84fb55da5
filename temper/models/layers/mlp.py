"""SwiGLU feed-forward."""

from collections.abc import Iterable

import torch
from torch import nn

from temper.kernels.swiglu import swiglu, swiglu_linear
from temper.models.layers.context import ForwardContext
from temper.models.layers.init import init_linear


class FeedForward(nn.Module):
    """``w2(silu(w1 x) * w3 x)``: w1 is HF's gate_proj, w3 up_proj, w2 down_proj."""

    keep_product: bool = False
    """Keep the SwiGLU's product for the down projection's backward instead of recomputing it
    (``swiglu_linear``). Full activation checkpointing sets it: it recomputes the whole block
    anyway, and a recomputation through ``swiglu_linear`` would run the down projection's
    matmul again (``keep_products``)."""

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
        references). A plain ``w2`` runs with the SwiGLU (``swiglu_linear``: the product is
        not kept for backward); one replaced by LoRA, float8 or QAT runs as its own module."""
        impl = None if ctx is None else ctx.kernels.swiglu
        gate, up = self.w1(x), self.w3(x)
        if type(self.w2) is nn.Linear and self.w2.bias is None and not self.keep_product:
            return swiglu_linear(gate, up, self.w2.weight, impl)
        return self.w2(swiglu(gate, up, impl))


def keep_products(blocks: Iterable[nn.Module]) -> None:
    """Every ``FeedForward`` in ``blocks`` keeps its SwiGLU product (``keep_product``): what a
    block that full activation checkpointing recomputes should do."""
    for block in blocks:
        for module in block.modules():
            if isinstance(module, FeedForward):
                module.keep_product = True
