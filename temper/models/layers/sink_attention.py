"""gpt-oss attention: rotary GQA with biases, a learned sink logit per head, and optionally a
sliding window.

A sink is a logit that joins every softmax row of its head and whose probability is dropped,
so a query can put mass "nowhere" instead of on some key. The math of windows and sinks lives
in ``temper.kernels.attention`` (every backend); this layer holds the parameter.
"""

import torch
from torch import nn

from temper.models.layers.attention import Attention, attend
from temper.models.layers.context import ForwardContext
from temper.models.layers.rope import apply_rope


class SinkAttention(Attention):
    """``Attention`` with ``sinks`` [n_heads], a ``window`` (None: full causal attention) and
    YaRN's ``rope_scale`` on cos and sin (transformers' attention factor)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        window: int | None,
        rope_scale: float = 1.0,
        bias: bool = True,
    ) -> None:
        super().__init__(dim, n_heads, n_kv_heads, head_dim, bias=bias)
        self.window = window
        self.rope_scale = rope_scale
        self.sinks = nn.Parameter(torch.empty(n_heads))

    def init_weights(self, std: float, out_std: float) -> None:
        super().init_weights(std, out_std)
        nn.init.normal_(self.sinks, std=std)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        b, s, _ = x.shape
        cos, sin = ctx.cos * self.rope_scale, ctx.sin * self.rope_scale
        q = apply_rope(self.wq(x).view(b, s, -1, self.head_dim), cos, sin, impl=ctx.kernels.rope)
        k = apply_rope(self.wk(x).view(b, s, -1, self.head_dim), cos, sin, impl=ctx.kernels.rope)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        out = self.sequence_core(self, q, k, v, ctx)
        return self.wo(out.reshape(b, s, -1))

    def mix_heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """With the sinks of the heads this part holds."""
        return attend(q, k, v, ctx, window=self.window, sinks=ctx.heads(self.sinks))
