"""DeepSeek V4: ``hc_mult`` residual streams mixed by hyper-connections around each block's
compressed attention and mixture of experts (hash-routed or top-k, plus a shared expert), a
hyper head collapsing the streams before the final norm.

Whole rows, packed or not (documents attend and compress apart), sequence- and
context-parallel ranks' tokens (each layer's attention gathers every rank's inputs for its keys
and compressed entries, ``temper.models.layers.compressed_attention``; everything else works
token by token), and
decoding with a KV cache (the reference's: each layer's inputs kept, keys and compressed
entries recomputed). Optional multi-token-prediction depths (``mtp``,
``temper.models.deepseek_v4.mtp``) run in training mode on the last block's streams and leave
the main model's outputs unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from temper.data.batch import SequenceShard
from temper.kernels.attention import DocumentMask
from temper.models.deepseek_v4.args import CSA, HCA, SLIDING, DeepseekV4Args
from temper.models.deepseek_v4.mtp import DeepseekV4MTP, mtp_block_args, predict_ahead
from temper.models.layers.compressed_attention import CompressedAttention, CompressedContext
from temper.models.layers.compressor import CompressedIndexer, Compressor, Windows
from temper.models.layers.context import ForwardContext
from temper.models.layers.decoder import INIT_STD, BlockAux, LanguageModel
from temper.models.layers.experts import GroupedExperts, limited_swiglu
from temper.models.layers.hyper_connections import HyperConnection, HyperHead, residual
from temper.models.layers.init import depth_scaled_std, init_linear
from temper.models.layers.kv_cache import KVCache, LayerCache, StaticKVCache
from temper.models.layers.moe import (
    MoE,
    RoutingStats,
    keep_routing,
    load_balancing_loss,
    load_imbalance,
    moe_layers,
)
from temper.models.layers.mtp import MTPLoss, mtp_loss
from temper.models.layers.norm import RMSNorm
from temper.models.layers.rope import rope_cos_sin, rope_inv_freq
from temper.models.layers.route_replay import RouterReplay
from temper.models.layers.routers import (
    GroupLimitedRouter,
    GroupLimitedRouting,
    HashRouter,
    update_expert_bias,
)
from temper.models.layers.whole_sequence import whole_sequence


class SharedExpert(nn.Module):
    """The SwiGLU every token goes through beside the routed experts, with V4's clamp."""

    def __init__(self, dim: int, hidden_dim: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, std: float, out_std: float) -> None:
        init_linear(self.w1, std)
        init_linear(self.w3, std)
        init_linear(self.w2, out_std)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.w2(limited_swiglu(self.w1(x), self.w3(x), self.limit, ctx.kernels.swiglu))


class DeepseekV4Block(nn.Module):
    """Attention then experts, each between the hyper-connection that reads its input from the
    streams and the ``residual`` that writes its output back."""

    def __init__(self, args: DeepseekV4Args, layer_id: int) -> None:
        super().__init__()
        hc = dict(sinkhorn_iters=args.hc_sinkhorn_iters, eps=args.hc_eps, norm_eps=args.norm_eps)
        self.attention_hc = HyperConnection(args.dim, args.hc_mult, **hc)
        self.ffn_hc = HyperConnection(args.dim, args.hc_mult, **hc)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = _attention(args, args.layer_types[layer_id])
        self.feed_forward = _moe(args, layer_id)
        self.shared_experts = SharedExpert(
            args.dim, args.n_shared_experts * args.moe_hidden_dim, args.swiglu_limit
        )

    def init_weights(self, std: float, out_std: float) -> None:
        for part in (self.attention_hc, self.ffn_hc):
            part.init_weights(std)
        for part in (self.attention, self.feed_forward, self.shared_experts):
            part.init_weights(std, out_std)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()

    def forward(
        self, streams: torch.Tensor, ctx: CompressedContext
    ) -> tuple[torch.Tensor, BlockAux]:
        """The streams after the block and its auxiliary outputs: its experts' routing
        statistics (``BlockAux.routing``; V4's indexer trains no KL term). Under sequence or
        context parallelism (``ctx.shard``) the streams are this rank's tokens, while the context's
        rotary, documents and windows span the whole sequence; the statistics leave the
        slice's padding out. Router replay's ``ctx.route`` and ``ctx.record_routes`` reach
        the experts as in the shared decoder."""
        x, post, comb = self.attention_hc(streams)
        out = self.attention(self.attention_norm(x, ctx.kernels), ctx)
        streams = residual(streams, out, post, comb)
        x, post, comb = self.ffn_hc(streams)
        h = self.ffn_norm(x, ctx.kernels)
        routed, stats = self.feed_forward(h, ctx)
        out = residual(streams, routed + self.shared_experts(h, ctx), post, comb)
        return out, BlockAux(stats)


def _attention(args: DeepseekV4Args, kind: str) -> CompressedAttention:
    eps = args.norm_eps
    compressor = indexer = None
    if kind == HCA:
        compressor = Compressor(
            args.dim, args.head_dim, args.hca_ratio, overlap=False, norm_eps=eps
        )
    elif kind == CSA:
        compressor = Compressor(args.dim, args.head_dim, args.csa_ratio, overlap=True, norm_eps=eps)
        indexer = CompressedIndexer(
            args.dim,
            args.q_lora_rank,
            args.index_n_heads,
            args.index_head_dim,
            args.csa_ratio,
            args.index_topk,
            norm_eps=eps,
        )
    return CompressedAttention(
        args.dim,
        args.n_heads,
        args.head_dim,
        args.q_lora_rank,
        o_groups=args.o_groups,
        o_lora_rank=args.o_lora_rank,
        window=args.sliding_window,
        norm_eps=eps,
        compressor=compressor,
        indexer=indexer,
    )


def _moe(args: DeepseekV4Args, layer_id: int) -> MoE:
    """Routed experts with the clamped SwiGLU; the router by token id (hash layers) or the
    one-group, ``sqrtsoftplus`` top-k with the balancing bias. Weights always renormalized,
    as transformers does whatever ``norm_topk_prob`` says."""
    router = None
    if args.is_hash_layer(layer_id):
        router = HashRouter(
            args.dim, args.n_experts, args.top_k, args.vocab_size, args.routed_scaling_factor
        )
    return MoE(
        args.dim,
        args.moe_hidden_dim,
        args.n_experts,
        args.top_k,
        True,
        group_limited=GroupLimitedRouting(1, 1, args.routed_scaling_factor, "sqrtsoftplus"),
        router=router,
        experts=GroupedExperts(args.dim, args.moe_hidden_dim, args.n_experts, args.swiglu_limit),
    )


class DeepseekV4Transformer(LanguageModel):
    """DeepSeek V4 causal LM: ``forward`` gives logits, ``hidden_states`` the head's input
    (``LanguageModel``'s, on whole rows, packed or not, sequence-parallel slices, or decoding
    with a growing ``KVCache``)."""

    attn_backend = "auto"
    """Set by the trainer like every family's; the reference attention runs on sdpa."""

    def __init__(self, args: DeepseekV4Args) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(DeepseekV4Block(args, i) for i in range(args.n_layers))
        self.hc_head = HyperHead(args.dim, args.hc_mult, eps=args.hc_eps, norm_eps=args.norm_eps)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        block_args = mtp_block_args(args)
        self.mtp = nn.ModuleList(
            DeepseekV4MTP(args, DeepseekV4Block(block_args, 0)) for _ in range(args.mtp_depth)
        )
        self.mtp_hidden: list[torch.Tensor] = []
        """Each depth's normed hidden states in the latest training forward (``mtp_loss``)."""
        self._mtp_shard: SequenceShard | None = None
        # Derived from args, never checkpointed: init_weights recomputes them after to_empty.
        main, compress = self._inv_freqs()
        self.register_buffer("inv_freq", main, persistent=False)
        self.register_buffer("compress_inv_freq", compress, persistent=False)
        self.router_replay = RouterReplay()
        """Router replay's routes to impose and record flag, for each forward's MoE layers."""
        self.last_routing: list[RoutingStats] = []
        """The routing statistics of the latest forward, one per layer."""

    def _inv_freqs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The sliding layers' rotary (plain) and the compressed layers' (``rope_scaling``);
        YaRN's attention factor is 1 here, as transformers sets it for V4."""
        args = self.args
        main = rope_inv_freq(args.qk_rope_head_dim, args.rope_theta)
        compress = rope_inv_freq(args.qk_rope_head_dim, args.compress_rope_theta, args.rope_scaling)
        return main, compress

    @torch.no_grad()
    def init_weights(self) -> None:
        """Materialize every parameter and buffer from the current torch RNG (after to_empty)."""
        args = self.args
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        main, compress = self._inv_freqs()
        self.inv_freq.copy_(main)
        self.compress_inv_freq.copy_(compress)
        nn.init.normal_(self.tok_embeddings.weight, std=INIT_STD)
        out_std = depth_scaled_std(INIT_STD, args.n_layers)
        for layer in self.layers:
            layer.init_weights(INIT_STD, out_std)
        self.hc_head.init_weights(INIT_STD)
        self.norm.reset_parameters()
        if not args.tie_embeddings:
            init_linear(self.output, INIT_STD)
        # After the main model's: with or without MTP its weights draw the same numbers.
        for depth in self.mtp:
            depth.init_weights(INIT_STD, out_std)

    def _hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        docs: DocumentMask | None,
        cache: KVCache | None,
        shard: SequenceShard | None,
    ) -> torch.Tensor:
        """``LanguageModel``'s body of ``hidden_states`` and ``forward``."""
        if isinstance(cache, StaticKVCache) or (
            cache is not None and (docs is not None or shard is not None)
        ):
            raise ValueError(
                "deepseek_v4 decodes with a growing KVCache on whole rows (no static cache, "
                "no packed documents, no sequence-parallel slices)"
            )
        b, s = input_ids.shape
        if position_ids is None:
            start = 0 if cache is None else cache.length
            position_ids = torch.arange(start, start + s, device=input_ids.device)[None]
        positions = position_ids.expand(b, s)
        if shard is not None:
            # Keys, windows and rotary span the whole sequence: every rank's positions.
            positions = whole_sequence(positions.contiguous(), shard)
        caches: tuple[LayerCache, ...] = ()
        if cache is not None:
            caches = tuple(cache.extend(s))
            # Every token so far: the compressors and the windows read the whole history.
            positions = caches[0].keep("positions", positions)
        if docs is not None:
            doc_ids = docs.doc_ids
        elif cache is not None:
            # Left padding: each padding column its own document, away from the real tokens.
            doc_ids = DocumentMask.from_position_ids(positions).doc_ids
        else:
            doc_ids = torch.zeros_like(positions)  # (a slice's right padding comes last)
        rotary = {
            SLIDING: rope_cos_sin(self.inv_freq, positions),
            CSA: rope_cos_sin(self.compress_inv_freq, positions),
        }
        rotary[HCA] = rotary[CSA]
        real_len = None if shard is None else shard.real_len
        ratios = {SLIDING: None, CSA: self.args.csa_ratio, HCA: self.args.hca_ratio}
        windows = {
            kind: None if ratio is None else Windows.of(positions, doc_ids, ratio, real_len)
            for kind, ratio in ratios.items()
            if kind in self.args.layer_types
        }
        h = self.tok_embeddings(input_ids)
        streams = h.unsqueeze(2).expand(-1, -1, self.args.hc_mult, -1)
        contexts = {
            kind: CompressedContext(
                *rotary[kind],
                shard=shard,
                kernels=self.kernels,
                caches=caches,
                doc_ids=doc_ids,
                windows=windows.get(kind),
                token_ids=input_ids,
                **self.router_replay.fields(self),
            )
            for kind in rotary
        }
        routing: list[RoutingStats] = []
        for i, (layer, kind) in enumerate(zip(self.layers, self.args.layer_types, strict=True)):
            streams, aux = layer(streams, contexts[kind].layer(i))
            keep_routing(routing, layer.feed_forward, aux.routing)
        self.last_routing = routing
        self.router_replay.keep(routing)
        self.mtp_hidden, self._mtp_shard = [], shard
        if len(self.mtp) and cache is None and self.training:
            depth_ctx = CompressedContext(
                *rotary[SLIDING], shard=shard, kernels=self.kernels, doc_ids=doc_ids
            )
            self.mtp_hidden = predict_ahead(
                self.mtp, streams, self.tok_embeddings, input_ids, depth_ctx, self.last_routing
            )
        return self.norm(self.hc_head(streams), self.kernels)

    def mtp_loss(
        self, labels: torch.Tensor, position_ids: torch.Tensor | None, chunk_tokens: int
    ) -> MTPLoss | None:
        """The MTP loss of the latest training forward for its ``labels`` [b, s] (the main
        targets; a sequence-parallel slice's, as its forward's) and packed ``position_ids``,
        through the head in chunks of ``chunk_tokens``; None without MTP depths."""
        if not len(self.mtp):
            return None
        if not self.mtp_hidden:
            raise RuntimeError("no MTP hidden states: run a training-mode forward first")
        # Released here: the graph keeps what backward needs, nothing keeps them past it.
        hidden, self.mtp_hidden = self.mtp_hidden, []
        weight = self.args.mtp_loss_weight
        head = self.output.weight
        return mtp_loss(hidden, head, labels, position_ids, weight, chunk_tokens, self._mtp_shard)

    def routing(self) -> list[RoutingStats]:
        """The routing of each MoE layer in the latest forward."""
        if not self.last_routing:
            raise RuntimeError("no routing statistics: run a forward first")
        return self.last_routing

    def aux_loss(self) -> torch.Tensor:
        """The load-balancing loss of the latest forward, before ``router_aux_loss_coef``."""
        return load_balancing_loss(self.routing())

    def load_imbalance(self) -> torch.Tensor:
        return load_imbalance(self.routing())

    def after_optimizer_step(self) -> None:
        """The aux-loss-free balancing step of the top-k layers (DeepSeek V3's, a
        ``PostStepHook``); hash layers have no bias."""
        routers = [
            m.router for m in moe_layers(self).values() if isinstance(m.router, GroupLimitedRouter)
        ]
        update_expert_bias(routers, self.args.expert_bias_update_rate)

    def active_params(self, trainable: bool | None = None) -> float:
        """Weights a token is multiplied by: all but the input embedding (a tied table counts
        once, as the head), routed experts as top_k / n_experts of theirs. ``trainable``:
        only the weights that do (True) or do not (False) train."""
        args = self.args

        def counted(params: object) -> int:
            return sum(
                p.numel() for p in params if trainable is None or p.requires_grad == trainable
            )

        n = counted(self.parameters())
        if not args.tie_embeddings:
            n -= counted([self.tok_embeddings.weight])
        experts = counted(p for m in moe_layers(self).values() for p in m.experts.parameters())
        return n - experts * (1 - args.top_k / args.n_experts)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at ``seq_len``: 6 per active weight that trains (4 per
        frozen one), plus the scores and weighted sums over the keys a query reads, 12 *
        n_heads * head_dim per key: its window, and the compressed entries (all of HCA's,
        CSA's ``index_topk``; what a sparse kernel computes, the reference masks dense
        scores). MTP depths count as sliding layers (their weights are among the active
        ones), and each applies the shared head once more."""
        args = self.args
        window = min(seq_len, args.sliding_window)
        keys = window * args.mtp_depth  # the MTP depths' sliding layers
        for kind in args.layer_types:
            keys += window
            if kind == HCA:
                keys += seq_len // args.hca_ratio
            elif kind == CSA:
                keys += min(seq_len // args.csa_ratio, args.index_topk)
        weights = 6.0 * self.active_params(trainable=True) + 4.0 * self.active_params(
            trainable=False
        )
        drafts_head = 6.0 * args.mtp_depth * self.output.weight.numel()
        return weights + drafts_head + 12.0 * args.n_heads * args.head_dim * keys
