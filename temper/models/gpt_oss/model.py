"""gpt-oss: the shared decoder with sink attention (alternating sliding and full) and an MoE
of biased, clamped-SwiGLU experts in every block."""

from torch import nn

from temper.models.gpt_oss.args import GptOssArgs
from temper.models.layers.clamped_moe import BiasedTopKRouter, ClampedSwiGLU, ClampedSwiGLUExperts
from temper.models.layers.moe import MoE
from temper.models.layers.moe_decoder import MoEDecoder
from temper.models.layers.sink_attention import SinkAttention


class GptOssTransformer(MoEDecoder):
    """gpt-oss causal LM. Inherited: ``forward``, ``hidden_states``, ``init_weights`` (the
    shared Decoder), ``aux_loss``, ``load_imbalance`` and the active-parameter count (the MoE
    skeleton). The FLOP count takes each sliding layer's scores over its window only."""

    args: GptOssArgs
    qk_norm = False
    attention_sinks = True

    @property
    def sliding_window(self) -> int | None:  # type: ignore[override]
        windows = {self.args.window(i) for i in range(self.args.n_layers)} - {None}
        return windows.pop() if windows else None

    def attention(self, layer_id: int) -> nn.Module:
        args = self.args
        return SinkAttention(
            args.dim,
            args.n_heads,
            args.n_kv_heads,
            args.head_dim,
            window=args.window(layer_id),
            rope_scale=args.rope_scale,
            bias=args.attention_bias,
        )

    def feed_forward(self, layer_id: int) -> nn.Module:
        args = self.args
        act = ClampedSwiGLU(args.swiglu_alpha, args.swiglu_limit)
        return MoE(
            args.dim,
            args.moe_hidden_dim,
            args.n_experts,
            args.top_k,
            norm_topk_prob=False,
            router=BiasedTopKRouter(args.dim, args.n_experts, args.top_k),
            experts=ClampedSwiGLUExperts(args.dim, args.moe_hidden_dim, args.n_experts, act),
        )

    def flops_per_token(self, seq_len: int) -> float:
        """The weights' (``weight_flops_per_token``) plus 12 * n_heads * head_dim per key each
        layer's queries see: ``seq_len`` keys in a full layer (full, not causal-halved, scores,
        as the shared count takes them), ``min(seq_len, window)`` in a sliding one."""
        args = self.args
        windows = (args.window(i) for i in range(args.n_layers))
        keys = sum(seq_len if w is None else min(seq_len, w) for w in windows)
        return self.weight_flops_per_token() + 12.0 * args.n_heads * args.head_dim * keys
