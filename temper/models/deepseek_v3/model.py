"""DeepSeek V3: the Qwen3-MoE decoder with multi-head latent attention and DeepSeek's router."""

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
from temper.models.qwen3_moe.model import Qwen3MoeTransformer


class DeepseekV3Transformer(Qwen3MoeTransformer):
    """DeepSeek V3 causal LM. Inherited from the shared Decoder and Qwen3-MoE: ``forward``,
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
            n_shared_experts=args.n_shared_experts,
        )

    def after_optimizer_step(self) -> None:
        """The aux-loss-free balancing step (a ``PostStepHook``): every MoE layer's bias moves
        by ``args.expert_bias_update_rate`` towards an even load over the tokens routed since
        the last step, counts summed over every rank (all of them route the global batch)."""
        routers = [m for m in self.modules() if isinstance(m, GroupLimitedRouter)]
        update_expert_bias(routers, self.args.expert_bias_update_rate)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token at ``seq_len``: the weights' (6 per
        active weight that trains, 4 per frozen one) plus MLA's scores, 6 * n_layers *
        n_heads * (qk_head_dim + v_head_dim) * seq_len (QK^T over qk_nope + qk_rope dims, AV
        over v dims; full, not causal-halved, as torchtitan counts)."""
        args = self.args
        head_dims = args.qk_head_dim + args.v_head_dim
        attention = 6.0 * args.n_layers * args.n_heads * head_dims * seq_len
        return self.weight_flops_per_token() + attention
