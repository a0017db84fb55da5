"""DeepSeek V3.2: DeepSeek V3 whose attention is DeepSeek Sparse Attention."""

from __future__ import annotations

import torch

from temper.models.deepseek_v3.model import DeepseekV3Transformer
from temper.models.deepseek_v32.args import DeepseekV32Args
from temper.models.layers.sparse_attention import SparseMLA


class DeepseekV32Transformer(DeepseekV3Transformer):
    """DeepSeek V3 (MoE, router, decoder) with ``SparseMLA`` in every layer. With
    ``indexer_training`` ``dense_warmup`` only the indexers' weights train."""

    args: DeepseekV32Args
    index_rope_interleaved: bool = False
    """The indexer rotates in the rotate-half layout (DeepSeek V3.2); GLM-5 in pairs."""

    def __init__(self, args: DeepseekV32Args) -> None:
        super().__init__(args)
        if args.indexer_training == "dense_warmup":
            for name, param in self.named_parameters():
                param.requires_grad_(".indexer." in name)

    def indexer_loss(self) -> torch.Tensor | None:
        """The indexers' KL term of the latest forward (its blocks' outputs, ``last_indexer_kl``),
        averaged over layers, before
        ``indexer_loss_weight``; None when it computed none (``indexer_training`` off, an
        eval-mode or no-grad forward, decoding)."""
        kls = self.last_indexer_kl
        return torch.stack(kls).mean() if kls else None

    def attention(self, layer_id: int) -> SparseMLA:
        """Layer ``layer_id``'s attention; without an indexer (GLM-5's shared layers) it
        reuses the choice of the latest layer with one."""
        args = self.args
        return SparseMLA(
            **self.mla_shape(),
            index_n_heads=args.index_n_heads,
            index_head_dim=args.index_head_dim,
            index_topk=args.index_topk,
            index_rope_interleaved=self.index_rope_interleaved,
            indexer_training=args.indexer_training,
            own_indexer=args.has_indexer(layer_id),
        )

    def weight_flops_per_token(self) -> float:
        """DeepSeek V3's count, less what never runs backward: the indexers' weights when they
        do not train (they score under ``no_grad``), and in ``dense_warmup`` every frozen
        weight (nothing before them trains; the indexers read detached inputs)."""
        if self.args.indexer_training == "dense_warmup":
            frozen = self.active_params(trainable=False)
            return 6.0 * self.active_params(trainable=True) + 2.0 * frozen
        flops = super().weight_flops_per_token()
        if self.args.indexer_training == "off":
            flops -= 4.0 * sum(p.numel() for n, p in self.named_parameters() if ".indexer." in n)
        return flops

    def flops_per_token(self, seq_len: int) -> float:
        """The weights' (``weight_flops_per_token``) plus each layer's
        ``attention_flops_per_token``: the sparse work, not dense MLA's."""
        args = self.args
        attention = sum(
            attention_flops_per_token(args, seq_len, args.has_indexer(i))
            for i in range(args.n_layers)
        )
        return self.weight_flops_per_token() + attention


def attention_flops_per_token(args: DeepseekV32Args, seq_len: int, indexer: bool) -> float:
    """One DSA layer's training FLOPs per token at ``seq_len`` beyond its weights, counting
    every earlier key as DeepSeek V3's count does (full, not causal-halved):

    - MLA's scores and weighted sum, 2 * n_heads * (qk_head_dim + v_head_dim) per key over
      ``index_topk`` keys at most (every key in ``dense_warmup``), times 3 for the backward
      (none in ``dense_warmup``, where nothing before the loss trains);
    - with ``indexer``, its scores over every key, 2 * index_n_heads * index_head_dim per key,
      times 3 when it trains;
    - when it trains, the KL's target: MLA's scores again, without gradient, over the keys
      attended (the reference computes them over every key; a sparse kernel need not).
    """
    warmup = args.indexer_training == "dense_warmup"
    trains = args.indexer_training != "off"
    keys = seq_len if warmup else min(seq_len, args.index_topk)
    mla = (2.0 if warmup else 6.0) * args.n_heads * (args.qk_head_dim + args.v_head_dim) * keys
    scores = (6.0 if trains else 2.0) * args.index_n_heads * args.index_head_dim * seq_len
    target = 2.0 * args.n_heads * args.qk_head_dim * keys if trains else 0.0
    return mla + (scores + target) * indexer
