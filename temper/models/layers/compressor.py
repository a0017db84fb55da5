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
(``Windows.visible``); packed documents compress apart, each as it would alone. Rotary pairs
are interleaved (2i, 2i + 1) on the last ``rope_dim`` dims of each head, DeepSeek V4's
layout, kept as is (``rope_tail``), since V4 reads its keys as values too.

This is the reference, for whole rows (packed or not); decoding recomputes the entries from
the inputs the cache keeps (``temper.models.layers.compressed_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from temper.kernels.dispatch import REFERENCE, Impl, Kernels
from temper.models.layers.init import init_linear
from temper.models.layers.norm import RMSNorm
from temper.models.layers.rope import apply_rope
from temper.models.layers.sparse_attention import index_scores, select_top_k


def rope_tail(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, impl: Impl | None = None
) -> torch.Tensor:
    """Rotate the last ``cos.shape[-1]`` dims of x [b, s, h, d] in interleaved pairs by cos/sin
    [b, s, rope_dim] (rotate-half layout, ``rope_cos_sin``'s), leaving the pairs in place;
    ``impl``: the rotation's kernel (None: the reference)."""
    r = cos.shape[-1]
    turned = apply_rope(x[..., -r:], cos, sin, True, impl)  # interleaved: evens, then odds
    turned = torch.stack(turned.chunk(2, dim=-1), dim=-1).flatten(-2)
    return torch.cat((x[..., :-r], turned), dim=-1)


@dataclass(frozen=True)
class Windows:
    """The complete windows of ``ratio`` tokens of a forward's rows [b, s]: a window starts
    where a token's position in its document is a multiple of ``ratio`` and the document
    holds the next ``ratio - 1`` tokens too, so packed documents compress on their own, as
    each would alone. A row of s tokens holds at most ``n = s // ratio`` windows (they are
    disjoint), the slots it does not fill are not ``valid``: no data-dependent size, so no
    sync with the device (and the dry run's meta forward works)."""

    ratio: int
    starts: torch.Tensor
    """[b, n] the token index of each window's first token (0 in slots not ``valid``)."""
    valid: torch.Tensor
    """[b, n] bool."""
    has_previous: torch.Tensor
    """[b, n] bool: the window follows another of its document (CSA's overlap reads it)."""
    positions: torch.Tensor
    """[b, s] each token's position in its document."""
    doc_ids: torch.Tensor
    """[b, s] each token's document."""

    @classmethod
    def of(
        cls, positions: torch.Tensor, doc_ids: torch.Tensor, ratio: int, real_len: int | None = None
    ) -> Windows:
        """The windows of rows whose tokens sit at ``positions`` in documents ``doc_ids``
        (both [b, s]). ``real_len``: the rows' first ``real_len`` tokens are real, the rest
        right padding (a sequence-parallel batch's); the slots then number as for the real
        tokens alone, so that CSA's top-k runs over as many entries as one process's (its
        ties, exact zeros after the indexer's ReLU, fall by column)."""
        b, s = positions.shape
        ends_in_doc = torch.zeros_like(doc_ids, dtype=torch.bool)
        if s >= ratio:
            fits = s - ratio + 1
            ends_in_doc[:, :fits] = doc_ids[:, ratio - 1 :] == doc_ids[:, :fits]
        starts_here = (positions % ratio == 0) & ends_in_doc
        counts = starts_here.sum(dim=1)
        n = (s if real_len is None else real_len) // ratio
        # Stable: the start tokens first, in row order.
        starts = (~starts_here).to(torch.uint8).sort(dim=1, stable=True).indices[:, :n]
        valid = torch.arange(n, device=positions.device) < counts[:, None]
        starts = starts.masked_fill(~valid, 0)
        has_previous = valid & (positions.gather(1, starts) >= ratio)
        return cls(ratio, starts, valid, has_previous, positions, doc_ids)

    def visible(self) -> torch.Tensor:
        """[b, s, n] True where a query sees a window's entry: a valid one of its own document
        that has ended at or before the query."""
        first = self.positions.gather(1, self.starts)
        same_doc = self.doc_ids.unsqueeze(2) == self.doc_ids.gather(1, self.starts).unsqueeze(1)
        ended = first.unsqueeze(1) + self.ratio <= self.positions.unsqueeze(2) + 1
        return same_doc & ended & self.valid.unsqueeze(1)

    def gather(self, x: torch.Tensor, back: int = 0) -> torch.Tensor:
        """x [b, s, w] -> [b, n, ratio, w]: each window's tokens (``back`` windows earlier)."""
        b, n = self.starts.shape
        tokens = self.starts.unsqueeze(-1) + torch.arange(self.ratio, device=x.device)
        tokens = (tokens - back * self.ratio).clamp(0, x.shape[1] - 1).view(b, -1, 1)
        width = x.shape[-1]
        return x.gather(1, tokens.expand(-1, -1, width)).view(b, n, self.ratio, width)


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

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        windows: Windows,
        kernels: Kernels = REFERENCE,
    ) -> torch.Tensor:
        """The entries [b, n, head_dim] of x's ``windows`` (of this compressor's ratio);
        cos/sin [b, s, r] are the rotary of each token's position (an entry takes its
        window's first); its norm and rotary run as ``kernels`` says."""
        kv, gate = self.kv_proj(x), self.gate_proj(x)
        window_kv = windows.gather(kv)
        window_gate = windows.gather(gate) + self.position_bias
        if self.overlap:
            # Entry w pools 2 * ratio slots: the first halves of the document's window
            # before it (none for its first: a -inf gate weighs them 0), then its own
            # second halves.
            d = self.head_dim
            prev_gate = (windows.gather(gate, back=1) + self.position_bias)[..., :d]
            prev_gate = prev_gate.masked_fill(~windows.has_previous[..., None, None], -torch.inf)
            window_kv = torch.cat((windows.gather(kv, back=1)[..., :d], window_kv[..., d:]), 2)
            window_gate = torch.cat((prev_gate, window_gate[..., d:]), dim=2)
        weights = window_gate.softmax(dim=2, dtype=torch.float32).to(window_kv.dtype)
        entries = self.kv_norm((window_kv * weights).sum(dim=2), kernels)
        b = entries.shape[0]
        at = windows.starts.unsqueeze(-1).expand(-1, -1, cos.shape[-1])
        cos, sin = (t.expand(b, -1, -1).gather(1, at) for t in (cos, sin))
        return rope_tail(entries.unsqueeze(2), cos, sin, kernels.rope)[:, :, 0]


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
        windows: Windows,
        rows: torch.Tensor,
        kernels: Kernels = REFERENCE,
    ) -> torch.Tensor:
        """[b, n, entries] True at the entries of ``windows`` each of the n tokens of
        x [b, s, dim] at columns ``rows`` [n] (their query latent [b, n, q_lora_rank]) reads: its
        ``topk`` best of those it sees (all when fewer); cos/sin and ``kernels`` as for
        ``Compressor``."""
        b, n = q_latent.shape[:2]
        keys = self.compressor(x, cos, sin, windows, kernels)
        q = self.q_proj(q_latent).view(b, n, self.n_heads, self.head_dim)
        q = rope_tail(q, cos[:, rows], sin[:, rows], kernels.rope)
        scores = index_scores(q, keys, x[:, rows], self.weights_proj)
        return select_top_k(scores, windows.visible()[:, rows], self.topk)
