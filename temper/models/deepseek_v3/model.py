"""DeepSeek V3: the shared MoE decoder with multi-head latent attention and DeepSeek's router."""

from typing import Any

import torch
from torch import nn

from temper.data.batch import SequenceShard
from temper.kernels.attention import DocumentMask, prepare_documents
from temper.models.deepseek_v3.args import DeepseekV3Args
from temper.models.layers.context import ForwardContext
from temper.models.layers.decoder import INIT_STD, Block
from temper.models.layers.init import depth_scaled_std
from temper.models.layers.kv_cache import KVCache
from temper.models.layers.mla import MLA
from temper.models.layers.mlp import FeedForward
from temper.models.layers.moe import MoE, keep_routing, moe_layers
from temper.models.layers.moe_decoder import MoEDecoder
from temper.models.layers.mtp import MTPLoss, MultiTokenPredictor, mtp_loss, shifted_ids
from temper.models.layers.rope import rope_cos_sin
from temper.models.layers.routers import (
    GroupLimitedRouter,
    GroupLimitedRouting,
    update_expert_bias,
)


class DeepseekV3Transformer(MoEDecoder):
    """DeepSeek V3 causal LM. Inherited from the shared (MoE) decoder: ``forward``,
    ``hidden_states`` (packed documents, attention backends), ``init_weights``, ``aux_loss``,
    ``load_imbalance`` and the active-parameter count (shared experts in full, routed ones
    as top_k / n_experts). It states its attention (MLA), its MoE and the optional
    multi-token-prediction depths ``mtp`` (``temper.models.layers.mtp``), which run in training
    mode only and leave the main model's outputs unchanged."""

    args: DeepseekV3Args

    def __init__(self, args: DeepseekV3Args) -> None:
        super().__init__(args)
        # The depths are the layers after the last (HF's model.layers.{n_layers + k}).
        self.mtp = nn.ModuleList(
            MultiTokenPredictor(
                args.dim,
                args.norm_eps,
                Block(
                    args, self.attention(args.n_layers + k), self.feed_forward(args.n_layers + k)
                ),
            )
            for k in range(args.mtp_depth)
        )
        self.mtp_hidden: list[torch.Tensor] = []
        """Each depth's normed hidden states in the latest training forward (for ``mtp_loss``)."""
        self._mtp_shard: SequenceShard | None = None
        """The latest forward's shard: ``mtp_loss`` takes that forward's tokens' labels."""

    @torch.no_grad()
    def init_weights(self) -> None:
        """The main model's init, then the depths' (so with or without MTP the main weights
        draw the same numbers)."""
        super().init_weights()
        out_std = depth_scaled_std(INIT_STD, self.args.n_layers)
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
        """The shared decoder's; in training mode the MTP depths also run on its output (on
        this rank's tokens under sequence or context parallelism: ``shifted_ids`` finds their
        next tokens in the whole sequence)."""
        h = super()._hidden_states(input_ids, position_ids, docs, cache, shard)
        self.mtp_hidden, self._mtp_shard = [], shard
        if len(self.mtp) and cache is None and self.training:
            self.mtp_hidden = self._predict_ahead(h, input_ids, position_ids, docs, shard)
        return h

    def _predict_ahead(
        self,
        h: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        docs: DocumentMask | None,
        shard: SequenceShard | None,
    ) -> list[torch.Tensor]:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        cos, sin = rope_cos_sin(self.inv_freq, position_ids)
        # As the main layers' context: masks at the whole sequence's length, and the shard, so
        # the depth's attention runs under the same sequence core (Ulysses' or the ring).
        seq_len = h.shape[1] if shard is None else shard.seq_len
        backend, docs = prepare_documents(self.attn_backend, docs, h, seq_len)
        ctx = ForwardContext(cos, sin, docs, backend, shard, kernels=self.kernels)
        normed = []
        for k, depth in enumerate(self.mtp):
            # Wrapped, the last real columns hold the row's first tokens: their targets are
            # ignored, and causal attention keeps them from every other position.
            embedded = self.tok_embeddings(shifted_ids(input_ids, k + 1, shard))
            h, aux = depth(h, embedded, ctx)
            keep_routing(self.last_routing, depth.block.feed_forward, aux.routing)
            normed.append(depth.norm(h, self.kernels))
        return normed

    def mtp_loss(
        self, labels: torch.Tensor, position_ids: torch.Tensor | None, chunk_tokens: int
    ) -> MTPLoss | None:
        """The MTP loss of the latest training forward for its ``labels`` [b, s] (the main
        targets; this rank's, as its forward's tokens) and packed ``position_ids``, through the
        head in chunks of ``chunk_tokens`` (the objective's kernel choice); None without MTP
        depths."""
        if not len(self.mtp):
            return None
        if not self.mtp_hidden:
            raise RuntimeError("no MTP hidden states: run a training-mode forward first")
        # Released here: the graph keeps what backward needs, nothing keeps them past it.
        hidden, self.mtp_hidden = self.mtp_hidden, []
        return mtp_loss(
            hidden,
            self.output.weight,
            labels,
            position_ids,
            self.args.mtp_loss_weight,
            chunk_tokens,
            self._mtp_shard,
        )

    def attention(self, layer_id: int) -> nn.Module:
        return MLA(**self.mla_shape())

    def mla_shape(self) -> dict[str, Any]:
        """MLA's sizes and rotary settings from the args, for this family's layers and for
        the families whose attention extends MLA (DSA's ``SparseMLA``)."""
        args = self.args
        return dict(
            dim=args.dim,
            n_heads=args.n_heads,
            q_lora_rank=args.q_lora_rank,
            kv_lora_rank=args.kv_lora_rank,
            qk_nope_head_dim=args.qk_nope_head_dim,
            qk_rope_head_dim=args.qk_rope_head_dim,
            v_head_dim=args.v_head_dim,
            softmax_scale=args.softmax_scale,
            rope_scale=args.rope_scale,
            rope_interleaved=args.rope_interleave,
        )

    def feed_forward(self, layer_id: int) -> nn.Module:
        args = self.args
        if not args.is_moe_layer(layer_id):
            return FeedForward(args.dim, args.ffn_hidden_dim)
        return MoE(
            args.dim,
            args.moe_hidden_dim,
            args.n_experts,
            args.top_k,
            args.norm_topk_prob,
            group_limited=GroupLimitedRouting(
                args.n_groups, args.topk_group, args.routed_scaling_factor
            ),
            shared_hidden_dim=args.n_shared_experts * args.moe_hidden_dim,
        )

    def after_optimizer_step(self) -> None:
        """The aux-loss-free balancing step (a ``PostStepHook``): every MoE layer's bias moves
        by ``args.expert_bias_update_rate`` towards an even load over the tokens routed since
        the last step, counts summed over every rank (all of them route the global batch)."""
        routers = [
            m.router for m in moe_layers(self).values() if isinstance(m.router, GroupLimitedRouter)
        ]
        update_expert_bias(routers, self.args.expert_bias_update_rate)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token at ``seq_len``: the weights' (6 per
        active weight that trains, 4 per frozen one) plus MLA's scores, 6 * n_layers *
        n_heads * (qk_head_dim + v_head_dim) * seq_len (QK^T over qk_nope + qk_rope dims, AV
        over v dims; full, not causal-halved, as torchtitan counts). MTP depths count as
        layers (their weights are among the active ones), and each applies the shared head
        once more."""
        args = self.args
        head_dims = args.qk_head_dim + args.v_head_dim
        layers = args.n_layers + args.mtp_depth
        attention = 6.0 * layers * args.n_heads * head_dims * seq_len
        drafts_head = args.mtp_depth * self.output.weight.numel()
        return self.weight_flops_per_token() + 6.0 * drafts_head + attention
