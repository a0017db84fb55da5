"""gpt-oss attention: rotary GQA with biases, a learned sink logit per head, and optionally a
sliding window.

A sink is a logit that joins every softmax row of its head and whose probability is dropped,
so a query can put mass "nowhere" instead of on some key. The math of windows and sinks lives
in ``temper.kernels.attention`` (every backend); this layer holds the parameter.
"""

import torch
from torch import nn

from temper.kernels.attention import Backend, DocumentMask
from temper.models.layers.attention import Attention
from temper.models.layers.kv_cache import LayerCache
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

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        docs: DocumentMask | None = None,
        backend: Backend = "auto",
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        cos, sin = cos * self.rope_scale, sin * self.rope_scale
        q = apply_rope(self.wq(x).view(b, s, -1, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(b, s, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if cache is None:
            out = self.attend(q, k, v, docs, backend=backend, window=self.window, sinks=self.sinks)
        else:
            out = cache.attend(q, k, v, window=self.window, sinks=self.sinks)
        return self.wo(out.reshape(b, s, -1))
