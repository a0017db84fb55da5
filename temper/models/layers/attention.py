"""Grouped-query self-attention on [batch, seq, heads, head_dim] tensors."""

import torch
import torch.nn.functional as F
from torch import nn

from temper.models.layers.init import init_linear
from temper.models.layers.norm import RMSNorm
from temper.models.layers.rope import apply_rope


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA for q [b, s, h, d] and k, v [b, s, h_kv, d] -> [b, s, h, d].

    Heads stay on dim 2 so sequence-parallel all-to-alls can wrap this function unchanged;
    ``enable_gqa`` shares each k/v head across its query group without materializing copies.
    """
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=True,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


class Attention(nn.Module):
    """Rotary GQA self-attention with projections ``wq, wk, wv, wo``.

    ``qk_norm_eps`` adds ``q_norm`` and ``k_norm``: an RMSNorm over each head of q and k before
    rotary (Qwen3), which keeps attention logits bounded without a softmax cap.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        bias: bool = False,
        qk_norm_eps: float | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)
        no_norm = qk_norm_eps is None
        self.q_norm = nn.Identity() if no_norm else RMSNorm(head_dim, qk_norm_eps)
        self.k_norm = nn.Identity() if no_norm else RMSNorm(head_dim, qk_norm_eps)

    def init_weights(self, std: float, out_std: float) -> None:
        """``out_std`` is for ``wo``, which writes into the residual stream."""
        for linear, s in ((self.wq, std), (self.wk, std), (self.wv, std), (self.wo, out_std)):
            init_linear(linear, s)
        for norm in (self.q_norm, self.k_norm):
            if isinstance(norm, RMSNorm):
                norm.reset_parameters()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = apply_rope(self.q_norm(self.wq(x).view(b, s, -1, self.head_dim)), cos, sin)
        k = apply_rope(self.k_norm(self.wk(x).view(b, s, -1, self.head_dim)), cos, sin)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        return self.wo(causal_attention(q, k, v).reshape(b, s, -1))
