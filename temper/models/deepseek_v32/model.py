"""DeepSeek V3.2: DeepSeek V3 whose attention is DeepSeek Sparse Attention."""

from __future__ import annotations

import torch

from temper.models.deepseek_v3.model import DeepseekV3Transformer
from temper.models.deepseek_v32.args import DeepseekV32Args
from temper.models.layers.sparse_attention import SharedSelection, SparseMLA


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
        """The indexers' KL term of the latest forward, averaged over layers, before
        ``indexer_loss_weight``; None when it computed none (``indexer_training`` off, an
        eval-mode or no-grad forward, decoding)."""
        terms = [
            layer.attention.indexer_kl
            for i, layer in enumerate(self.layers)
            if self.args.has_indexer(i)
        ]
        kls = [t for t in terms if t is not None]
        return torch.stack(kls).mean() if len(kls) == len(terms) else None

    def attention(self, layer_id: int) -> SparseMLA:
        return self.sparse_mla(layer_id, None)

    def sparse_mla(self, layer_id: int, selection: SharedSelection | None) -> SparseMLA:
        """Layer ``layer_id``'s attention, sharing ``selection`` with the layers before or
        after it (GLM-5's cross-layer top-k)."""
        args = self.args
        return SparseMLA(
            **self.mla_shape(),
            index_n_heads=args.index_n_heads,
            index_head_dim=args.index_head_dim,
            index_topk=args.index_topk,
            index_rope_interleaved=self.index_rope_interleaved,
            indexer_training=args.indexer_training,
            selection=selection,
            own_indexer=args.has_indexer(layer_id),
        )

    def flops_per_token(self, seq_len: int) -> float:
        """DeepSeek V3's count with each query attending to at most ``index_topk`` keys (what
        a sparse kernel computes; the reference masks dense scores), plus the indexer's
        scores, forward only since the main loss does not train it: 2 * index_n_heads *
        index_head_dim * seq_len per layer with an indexer."""
        args = self.args
        indexed = sum(args.has_indexer(i) for i in range(args.n_layers))
        indexer = 2.0 * indexed * args.index_n_heads * args.index_head_dim * seq_len
        return super().flops_per_token(min(seq_len, args.index_topk)) + indexer
