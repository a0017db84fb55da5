"""DeepSeek V4's KV compressors: each window of ``ratio`` tokens becomes one compressed KV
entry that attention reads beside its sliding window of ordinary keys.

Each token t gives features ``c_t = W_kv x_t`` and gate logits ``z_t = W_z x_t``; window w's
entry is the gated average of its tokens' features, RMS-normalized, its last ``rope_dim``
dims rotated to the window's first position ``w * ratio``:

    e_w = rope(norm(sum_t softmax_t(z_t + B_t) * c_t))        over the window's tokens t

with ``B`` [ratio, width] a learned bias per slot. Heavily compressed attention (HCA, ratio
128) pools disjoint windows. Compressed sparse attention (CSA, ratio 4) pools overlapping
ones (``overlap``): features are twice as wide, and entry w pools ``2 * ratio`` slots, the
first half of window w - 1's features and the second half of window w's. CSA's queries then
read only the ``topk`` entries its ``CompressedIndexer`` scores best.

A query at position p sees entry w once the window is complete, ``(w + 1) * ratio <= p + 1``
(``compressed_visible``). Rotary pairs are interleaved (2i, 2i + 1) on the last ``rope_dim``
dims of each head, DeepSeek V4's layout, kept as is (``rope_tail``), since V4 reads its keys as
values too.

This is the reference, for whole sequences without a cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from temper.models.layers.init import init_linear
from temper.models.layers.norm import RMSNorm
from temper.models.layers.rope import apply_rope
from temper.models.layers.sparse_attention import index_scores, select_top_k


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last ``cos.shape[-1]`` dims of x [b, s, h, d] in interleaved pairs by cos/sin
    [b, s, rope_dim] (rotate-half layout, ``rope_cos_sin``'s), leaving the pairs in place."""
    r = cos.shape[-1]
    turned = apply_rope(x[..., -r:], cos, sin, interleaved=True)  # evens, then odds
    turned = torch.stack(turned.chunk(2, dim=-1), dim=-1).flatten(-2)
    return torch.cat((x[..., :-r], turned), dim=-1)


def compressed_visible(positions: torch.Tensor, n_entries: int, ratio: int) -> torch.Tensor:
    """[b, s, n_entries] True where the query at ``positions`` [b, s] sees the entry: its
    window of ``ratio`` tokens has ended at or before the query."""
    entries = torch.arange(n_entries, device=positions.device)
    return entries < torch.div(positions + 1, ratio, rounding_mode="floor").unsqueeze(-1)


class Compressor(nn.Module):
    """Pools each window of ``ratio`` tokens of x [b, s, dim] into one entry of ``head_dim``
    (module docstring); ``overlap`` for CSA's overlapping windows."""

    def __init__(
        self, dim: int, head_dim: int, ratio: int, *, overlap: bool, norm_eps: float
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.ratio = ratio
        self.overlap = overlap
        width = 2 * head_dim if overlap else head_dim
        self.kv_proj = nn.Linear(dim, width, bias=False)
        self.gate_proj = nn.Linear(dim, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(ratio, width))
        self.kv_norm = RMSNorm(head_dim, eps=norm_eps)

    def init_weights(self, std: float) -> None:
        init_linear(self.kv_proj, std)
        init_linear(self.gate_proj, std)
        nn.init.zeros_(self.position_bias)
        self.kv_norm.reset_parameters()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The entries [b, s // ratio, head_dim] of x's complete windows; cos/sin [b, s, r]
        are the rotary of each token's position (an entry takes its window's first)."""
        b, s, _ = x.shape
        n = s // self.ratio
        if n == 0:
            return x.new_zeros(b, 0, self.head_dim)
        x = x[:, : n * self.ratio]
        kv = self.kv_proj(x).view(b, n, self.ratio, -1)
        gate = self.gate_proj(x).view(b, n, self.ratio, -1) + self.position_bias
        if self.overlap:
            kv, gate = self._overlapping(kv, gate)
        pooled = (kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)
        firsts = slice(0, n * self.ratio, self.ratio)
        return rope_tail(self.kv_norm(pooled).unsqueeze(2), cos[:, firsts], sin[:, firsts])[:, :, 0]

    def _overlapping(
        self, kv: torch.Tensor, gate: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[b, n, 2 * ratio, head_dim] slots of each entry: window w - 1's first halves, then
        window w's second halves. Window 0 has no predecessor: a -inf gate weighs its slots 0."""
        d = self.head_dim
        before = (0, 0, 0, 0, 1, 0)  # one window in front of dim 1
        prev_kv = F.pad(kv[:, :-1, :, :d], before)
        prev_gate = F.pad(gate[:, :-1, :, :d], before, value=float("-inf"))
        return (
            torch.cat((prev_kv, kv[..., d:]), dim=2),
            torch.cat((prev_gate, gate[..., d:]), dim=2),
        )


class CompressedIndexer(nn.Module):
    """CSA's lightning indexer, scoring as DSA's (``index_scores``): its own overlapping
    ``Compressor`` (at ``head_dim``) gives the keys, the attention's query latent its
    ``n_heads`` query heads, and each query keeps the ``topk`` best-scored entries it sees.
    The choice is discrete and computed without gradient, as in transformers, so the
    language-model loss does not train the indexer."""

    def __init__(
        self,
        dim: int,
        q_lora_rank: int,
        n_heads: int,
        head_dim: int,
        ratio: int,
        topk: int,
        *,
        norm_eps: float,
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.topk = topk
        self.compressor = Compressor(dim, head_dim, ratio, overlap=True, norm_eps=norm_eps)
        self.q_proj = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(dim, n_heads, bias=False)

    def init_weights(self, std: float) -> None:
        self.compressor.init_weights(std)
        init_linear(self.q_proj, std)
        init_linear(self.weights_proj, std)

    @torch.no_grad()
    def forward(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """[b, s, t] True at the entries each query of x [b, s, dim] reads: its ``topk`` best of
        those ``visible`` [b, s, t] (all when fewer); cos/sin as for ``Compressor``."""
        b, s, _ = x.shape
        keys = self.compressor(x, cos, sin)
        q = rope_tail(self.q_proj(q_latent).view(b, s, self.n_heads, self.head_dim), cos, sin)
        return select_top_k(index_scores(q, keys, x, self.weights_proj), visible, self.topk)
