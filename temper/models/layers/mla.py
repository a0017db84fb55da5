"""Multi-head latent attention (DeepSeek V2/V3) on [batch, seq, heads, head_dim] tensors."""

import torch
from torch import nn

from temper.kernels.dispatch import REFERENCE, Kernels
from temper.models.layers.attention import attend
from temper.models.layers.context import ForwardContext, SequenceCore, local_core
from temper.models.layers.init import init_linear
from temper.models.layers.norm import RMSNorm
from temper.models.layers.rope import apply_rope

LATENT_NORM_EPS = 1e-6
"""transformers builds ``q_a_layernorm`` and ``kv_a_layernorm`` with this eps whatever the
config's ``rms_norm_eps`` is; the block norms use the config's."""


class MLA(nn.Module):
    """Attention whose keys and values are expanded from one small latent per token.

    ``wkv_a`` makes the latent (``kv_lora_rank``, normed by ``kv_norm``) and one shared rotary
    key of ``qk_rope_head_dim``; ``wkv_b`` expands the latent into each head's no-rope key
    (``qk_nope_head_dim``) and value (``v_head_dim``). Queries come from ``wq``, or with
    ``q_lora_rank`` through their own normed latent (``wq_a``, ``q_norm``, ``wq_b``). Rotary
    embeddings touch only the rope part of q and k; ``rope_interleaved`` reads that part in
    DeepSeek's interleaved-pair layout. Numerically as transformers' DeepseekV3Attention.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        *,
        softmax_scale: float,
        rope_scale: float = 1.0,
        rope_interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.softmax_scale = softmax_scale
        self.rope_scale = rope_scale
        self.rope_interleaved = rope_interleaved
        q_dim = n_heads * (qk_nope_head_dim + qk_rope_head_dim)
        if q_lora_rank is None:
            self.wq = nn.Linear(dim, q_dim, bias=False)
        else:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(q_lora_rank, q_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        self.sequence_core: SequenceCore = local_core

    def init_weights(self, std: float, out_std: float) -> None:
        """``out_std`` is for ``wo``, which writes into the residual stream."""
        inputs = [self.wq] if self.q_lora_rank is None else [self.wq_a, self.wq_b]
        for linear in (*inputs, self.wkv_a, self.wkv_b):
            init_linear(linear, std)
        init_linear(self.wo, out_std)
        norms = [self.kv_norm] if self.q_lora_rank is None else [self.q_norm, self.kv_norm]
        for norm in norms:
            norm.reset_parameters()

    def project(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kernels: Kernels = REFERENCE,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q, k [b, s, n_heads, qk_head_dim] with rotary applied, v [b, s, n_heads,
        v_head_dim], and the normed query latent [b, s, q_lora_rank] (None without
        ``q_lora_rank``), which DeepSeek sparse attention's indexer reads too; the norms and
        rotary run as ``kernels`` says."""
        b, s, _ = x.shape
        q_latent = None if self.q_lora_rank is None else self.q_norm(self.wq_a(x), kernels)
        q = self.wq(x) if q_latent is None else self.wq_b(q_latent)
        q_nope, q_rope = q.view(b, s, self.n_heads, -1).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1
        )
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_nope, v = (
            self.wkv_b(self.kv_norm(latent, kernels))
            .view(b, s, self.n_heads, -1)
            .split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        )
        # YaRN's attention factor scales cos and sin in fp32, before the cast, as in HF.
        cos, sin = cos * self.rope_scale, sin * self.rope_scale
        q_rope = apply_rope(q_rope, cos, sin, self.rope_interleaved, kernels.rope)
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin, self.rope_interleaved, kernels.rope)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, -1, self.n_heads, -1)), dim=-1)
        return q, k, v, q_latent

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [b, s, dim] -> [b, s, dim], with the fp32 rotary tables [b, s, qk_rope_head_dim]
        of ``ctx``; a KV cache (decoding) keeps the expanded per-head keys and values."""
        q, k, v, _ = self.project(x, ctx.cos, ctx.sin, ctx.kernels)
        out = self.sequence_core(self, q, k, v, ctx)
        return self.wo(out.flatten(2))

    def mix_heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        return attend(q, k, v, ctx, scale=self.softmax_scale)
