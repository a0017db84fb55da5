"""DeepSeek V3: the shared MoE decoder with multi-head latent attention and DeepSeek's router."""

import torch.distributed as dist
from torch import nn

from temper.models.deepseek_v3.args import DeepseekV3Args
from temper.models.layers.mla import MLA
from temper.models.layers.mlp import FeedForward
from temper.models.layers.moe import (
    GroupLimitedRouter,
    GroupLimitedRouting,
    MoE,
    update_expert_bias,
)
from temper.models.layers.moe_decoder import MoEDecoder


class DeepseekV3Transformer(MoEDecoder):
    """DeepSeek V3 causal LM. Inherited from the shared (MoE) decoder: ``forward``,
    ``hidden_states`` (packed documents, attention backends), ``init_weights``, ``aux_loss``,
    ``load_imbalance`` and the active-parameter count (shared experts in full, routed ones
    as top_k / n_experts). It states only its attention (MLA) and its MoE."""

    args: DeepseekV3Args

    def attention(self, layer_id: int) -> nn.Module:
        args = self.args
        return MLA(
            args.dim,
            args.n_heads,
            args.q_lora_rank,
            args.kv_lora_rank,
            args.qk_nope_head_dim,
            args.qk_rope_head_dim,
            args.v_head_dim,
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

    def update_expert_bias(self, rate: float, group: dist.ProcessGroup | None = None) -> None:
        """The aux-loss-free balancing step, for the trainer to call after each optimizer step
        (with ``args.expert_bias_update_rate``): every MoE layer's bias moves by ``rate``
        towards an even load over the tokens routed since the last call, counts summed over
        ``group`` (the data-parallel ranks; default: the world)."""
        routers = [m for m in self.modules() if isinstance(m, GroupLimitedRouter)]
        update_expert_bias(routers, rate, group)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token at ``seq_len``: 6 per active weight
        plus MLA's scores, 6 * n_layers * n_heads * (qk_head_dim + v_head_dim) * seq_len
        (QK^T over qk_nope + qk_rope dims, AV over v dims; full, not causal-halved, as
        torchtitan counts)."""
        args = self.args
        head_dims = args.qk_head_dim + args.v_head_dim
        attention = 6.0 * args.n_layers * args.n_heads * head_dims * seq_len
        return 6.0 * self.active_params() + attention
