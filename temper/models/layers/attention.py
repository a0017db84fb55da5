"""Grouped-query self-attention on [batch, seq, heads, head_dim] tensors.

``causal_attention(q, k, v, docs=None, *, backend="auto", scale=None)`` is the dispatcher of
``temper.kernels.attention``: causal, or block-causal over the packed documents of a
``DocumentMask``, through sdpa, flex or varlen. ``attend`` is every attention layer's
cross-token step (``mix_heads``): that dispatcher, ring attention under context parallelism,
or the KV cache while decoding.
"""

from collections.abc import Callable

import torch
from torch import nn

from temper.kernels.attention import DocumentMask
from temper.kernels.attention import attention as causal_attention
from temper.kernels.ring_attention import ring_attention
from temper.models.layers.context import ForwardContext, SequenceCore, local_core
from temper.models.layers.init import init_linear
from temper.models.layers.norm import NoNorm, RMSNorm
from temper.models.layers.rope import apply_rope

__all__ = ["Attention", "GatedAttention", "LogitMax", "attend", "causal_attention"]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: ForwardContext,
    *,
    scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [b, s, h, d] over k, v [b, s, h_kv, d(_v)] as ``ctx`` says: causal or block-causal
    over ``ctx.docs`` on ``ctx.backend``, or as ring attention over ``ctx.context_group``;
    or, decoding, over every key in ``ctx.cache`` after storing these (only the keys of
    ``ctx.selected`` when sparse attention set it)."""
    if ctx.context_group is not None:
        return ring_attention(
            q,
            k,
            v,
            ctx.docs,
            ctx.context_group,
            scale=scale,
            window=window,
            sinks=sinks,
            fused=ctx.kernels.fused_ring_attention,
        )
    if ctx.cache is not None:
        return ctx.cache.attend(
            q, k, v, scale=scale, window=window, sinks=sinks, chosen=ctx.selected
        )
    return causal_attention(
        q, k, v, ctx.docs, backend=ctx.backend, scale=scale, window=window, sinks=sinks
    )


class LogitMax:
    """Each head's largest attention logit since the last `take` (QK-clip's statistic).

    ``paused`` (while the optimizer is offloaded, e.g. during rollouts) ignores forwards.
    Computing it costs one more ``q k^T`` per layer, without gradient, and holds its fp32
    ``[b, h, s, s]`` logits meanwhile (a reference path: no fused kernel returns the max).
    """

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None
        self.paused = False

    @torch.no_grad()
    def observe(self, q: torch.Tensor, k: torch.Tensor, docs: DocumentMask | None) -> None:
        """q [b, s, h, d] and k [b, s, h_kv, d] after rotary; only the pairs attention sees."""
        if self.paused:
            return
        k = k.repeat_interleave(q.size(2) // k.size(2), dim=2)
        logits = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * q.size(-1) ** -0.5
        if docs is None:
            s = q.size(1)
            mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        else:
            mask = docs.dense()
        heads = logits.masked_fill(~mask, -torch.inf).amax(dim=(0, 2, 3))
        self.value = heads if self.value is None else torch.maximum(self.value, heads)

    def take(self) -> torch.Tensor | None:
        """The maxima so far (None if no forward was seen), and a fresh start."""
        value, self.value = self.value, None
        return value


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
        self.q_norm = NoNorm() if no_norm else RMSNorm(head_dim, qk_norm_eps)
        self.k_norm = NoNorm() if no_norm else RMSNorm(head_dim, qk_norm_eps)
        self.sequence_core: SequenceCore = local_core
        # QK-clip (``optimizer.muon_qk_clip``) sets this to track each head's largest logit.
        self.logit_max: LogitMax | None = None

    def init_weights(self, std: float, out_std: float) -> None:
        """``out_std`` is for ``wo``, which writes into the residual stream."""
        for linear, s in ((self.wq, std), (self.wk, std), (self.wv, std), (self.wo, out_std)):
            init_linear(linear, s)
        for norm in (self.q_norm, self.k_norm):
            if isinstance(norm, RMSNorm):
                norm.reset_parameters()

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        b, s, _ = x.shape
        kernels = ctx.kernels
        q = self.q_norm(self.wq(x).view(b, s, -1, self.head_dim), kernels)
        k = self.k_norm(self.wk(x).view(b, s, -1, self.head_dim), kernels)
        q = apply_rope(q, ctx.cos, ctx.sin, impl=kernels.rope)
        k = apply_rope(k, ctx.cos, ctx.sin, impl=kernels.rope)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.logit_max is not None and ctx.cache is None:
            self.logit_max.observe(q, k, ctx.docs)
        out = self.sequence_core(self, q, k, v, ctx)
        return self.wo(out.reshape(b, s, -1))

    def mix_heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        return attend(q, k, v, ctx)


class GatedAttention(nn.Module):
    """Rotary GQA whose output is gated per channel: ``wo(attn(q, k, v) * sigmoid(gate))``
    (Qwen3-Next, Qwen3.5).

    ``wq`` yields, per head, the query then its gate (HF's ``q_proj`` layout). q and k pass a
    per-head ``norm_cls`` (the zero-centred RMSNorm in those checkpoints) before rotary, which
    rotates the first ``cos.shape[-1]`` dims of each head only (partial rotary).
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        norm_cls: Callable[[int, float], nn.Module],
        norm_eps: float,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, 2 * n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)
        self.q_norm = norm_cls(head_dim, norm_eps)
        self.k_norm = norm_cls(head_dim, norm_eps)
        self.sequence_core: SequenceCore = local_core

    def init_weights(self, std: float, out_std: float) -> None:
        """``out_std`` is for ``wo``, which writes into the residual stream."""
        for linear, s in ((self.wq, std), (self.wk, std), (self.wv, std), (self.wo, out_std)):
            init_linear(linear, s)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        b, s, _ = x.shape
        q, gate = self.wq(x).view(b, s, -1, 2 * self.head_dim).chunk(2, dim=-1)
        kernels = ctx.kernels
        q = apply_rope(self.q_norm(q, kernels), ctx.cos, ctx.sin, impl=kernels.rope)
        k = self.k_norm(self.wk(x).view(b, s, -1, self.head_dim), kernels)
        k = apply_rope(k, ctx.cos, ctx.sin, impl=kernels.rope)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        out = self.sequence_core(self, q, k, v, ctx)
        return self.wo(out.reshape(b, s, -1) * gate.reshape(b, s, -1).sigmoid())

    def mix_heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        return attend(q, k, v, ctx)
