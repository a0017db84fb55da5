"""DeepSeek V4's attention: one shared key-value head (MQA whose keys are its values), a sliding
window of ordinary keys, and in compressed layers the entries of a ``Compressor`` beside them.

    q   = rope(rms(W_qb norm(W_qa x)))          per head, no gain in the rms
    kv  = rope(norm(W_kv x))                     one head, read as key and as value
    o   = softmax_with_sink(q [kv_window ; entries]^T / sqrt(d)) [kv_window ; entries]
    out = W_ob W_oa(rope^-1(o))                  grouped output projection

Rotary turns the last ``rope_dim`` dims of each head (``rope_tail``). Since values carry the
keys' rotation, the output is turned back by the query's position (``-sin``), which leaves each
value's contribution a function of the distance to the query. A sliding layer attends within
its ``window`` only; an HCA layer also to every completed compressed entry; a CSA layer to the
``topk`` entries its indexer picks. Each head has a learned sink logit.

The reference runs on sdpa with an explicit mask over [window keys ; entries], on whole rows
(packed documents attend and compress apart). That mask is the selection of the sparse
attention kernel (``temper.kernels.sparse_attention.compressed_attention``, whose form
``kernels.compressed_attention`` picks): its Triton form reads only each query's window keys
and visible or picked entries, serves the shared head to every query head by its offset and
keeps the sinks in its softmax. Under sequence or context parallelism each rank gathers every
rank's inputs in sequence order (``whole_sequence``, with autograd: each rank's gradient goes
back to it), builds the keys and compressed entries of the whole sequence from them, and
attends with its own tokens' queries (a Ulysses slice, or CP's two load-balanced chunks), all
heads: the sliding window, the shared KV head and the compressors' windows then span ranks as
they do in one process. Decoding, it keeps each layer's inputs in the KV cache and
recomputes keys and compressed entries from them for the new queries: exact, at the cost of a
forward over the whole history per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from temper.kernels.attention import causal_band
from temper.kernels.sparse_attention import compressed_attention
from temper.models.layers.compressor import CompressedIndexer, Compressor, Windows, rope_tail
from temper.models.layers.context import ForwardContext
from temper.models.layers.grouped_linear import GroupedLinear
from temper.models.layers.init import init_linear
from temper.models.layers.norm import RMSNorm
from temper.models.layers.whole_sequence import local_part, whole_sequence


@dataclass(frozen=True)
class CompressedContext(ForwardContext):
    """DeepSeek V4's forward context: the shared one, with ``cos``/``sin`` its layer kind's
    rotary over all s tokens (the whole sequence under sequence parallelism, the whole
    history when decoding), and what its compressed attention reads besides."""

    doc_ids: torch.Tensor | None = None
    """[b, s] each token's document (packed ones attend and compress apart); the model
    always sets it."""
    windows: Windows | None = None
    """The compressor's windows over the s tokens, of the layer's ratio (compressed layers)."""


class CompressedAttention(nn.Module):
    """V4 attention (module docstring). ``compressor`` None: a sliding layer; an ``indexer``
    makes a compressed layer sparse (CSA)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        head_dim: int,
        q_lora_rank: int,
        *,
        o_groups: int,
        o_lora_rank: int,
        window: int,
        norm_eps: float,
        compressor: Compressor | None = None,
        indexer: CompressedIndexer | None = None,
    ) -> None:
        super().__init__()
        if (n_heads * head_dim) % o_groups:
            raise ValueError(f"o_groups {o_groups} must divide n_heads * head_dim")
        if indexer is not None and compressor is None:
            raise ValueError("an indexer picks compressed entries: it needs a compressor")
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.o_groups = o_groups
        self.window = window
        self.norm_eps = norm_eps
        self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
        self.q_norm = RMSNorm(q_lora_rank, eps=norm_eps)
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wkv = nn.Linear(dim, head_dim, bias=False)
        self.kv_norm = RMSNorm(head_dim, eps=norm_eps)
        self.wo_a = GroupedLinear(n_heads * head_dim // o_groups, o_groups * o_lora_rank, o_groups)
        self.wo_b = nn.Linear(o_groups * o_lora_rank, dim, bias=False)
        self.sinks = nn.Parameter(torch.empty(n_heads))
        self.compressor = compressor
        self.indexer = indexer

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.wq_a, self.wq_b, self.wkv):
            init_linear(linear, std)
        self.wo_a.init_weights(std)
        init_linear(self.wo_b, out_std)
        self.q_norm.reset_parameters()
        self.kv_norm.reset_parameters()
        nn.init.zeros_(self.sinks)
        for part in (self.compressor, self.indexer):
            if part is not None:
                part.init_weights(std)

    def forward(self, x: torch.Tensor, ctx: CompressedContext) -> torch.Tensor:
        """x [b, n, dim] of whole rows, of the next n tokens with a ``ctx.cache`` (decoding:
        the cache keeps every earlier input, from which keys and entries are recomputed), or
        of this rank's tokens of each row with a sequence- or context-parallel ``ctx.shard``
        (every rank's are gathered into the keys' side); ``ctx.doc_ids``,
        ``ctx.cos``/``ctx.sin`` and ``ctx.windows`` span all s tokens (``CompressedContext``)."""
        cos, sin, doc_ids, windows, shard = ctx.cos, ctx.sin, ctx.doc_ids, ctx.windows, ctx.shard
        b, n, _ = x.shape
        q_x = x
        if ctx.cache is not None:
            x = ctx.cache.keep("inputs", x)
        elif shard is not None:
            x = whole_sequence(x, shard)
        s = x.shape[1]
        if shard is None:
            # The n queries are the newest of the s tokens (all of them without a cache).
            rows = torch.arange(s - n, s, device=x.device)
            band = causal_band(n, s, self.window, x.device)
        else:
            # This rank's columns of the whole sequence: a slice, or CP's two chunks.
            rows = local_part(torch.arange(s, device=x.device)[None], shard)[0]
            band = causal_band(s, s, self.window, x.device)[rows]
        q_cos, q_sin, q_docs = cos[:, rows], sin[:, rows], doc_ids[:, rows]
        q_latent = self.q_norm(self.wq_a(q_x), ctx.kernels)
        q = self.wq_b(q_latent).view(b, n, self.n_heads, self.head_dim)
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.norm_eps).to(q.dtype)
        rope = ctx.kernels.rope
        q = rope_tail(q, q_cos, q_sin, rope)
        kv = rope_tail(self.kv_norm(self.wkv(x), ctx.kernels).unsqueeze(2), cos, sin, rope)
        sees = band & (q_docs[:, :, None] == doc_ids[:, None])
        if self.compressor is not None:
            if windows is None or windows.ratio != self.compressor.ratio:
                raise ValueError(f"a compressed layer needs its windows of {self.compressor.ratio}")
            entries = self.compressor(x, cos, sin, windows, ctx.kernels)
            if self.indexer is None:
                seen = windows.visible()[:, rows]
            else:
                seen = self.indexer(x, q_latent, cos, sin, windows, rows, ctx.kernels)
            kv = torch.cat((kv, entries.unsqueeze(2)), dim=1)
            sees = torch.cat((sees, seen), dim=-1)
        impl = ctx.kernels.compressed_attention
        out = compressed_attention(q, kv, sees, self.head_dim**-0.5, self.sinks, impl)
        out = rope_tail(out, q_cos, -q_sin, rope)
        return self.wo_b(self.wo_a(out.reshape(b, n, self.o_groups, -1)).flatten(2))
