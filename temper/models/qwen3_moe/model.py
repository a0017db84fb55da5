"""Qwen3-MoE: the shared MoE decoder with Qwen3's q/k norm and token-choice expert MLPs."""

from torch import nn

from temper.models.layers.mlp import FeedForward
from temper.models.layers.moe import MoE
from temper.models.layers.moe_decoder import MoEDecoder
from temper.models.qwen3_moe.args import Qwen3MoeArgs


class Qwen3MoeTransformer(MoEDecoder):
    """Qwen3-MoE causal LM: per-head q/k RMSNorm before rotary (as Qwen3), and an MoE MLP
    (softmax top-k router) where ``args.is_moe_layer``, a dense SwiGLU elsewhere."""

    args: Qwen3MoeArgs
    qk_norm = True

    def feed_forward(self, layer_id: int) -> nn.Module:
        args = self.args
        if not args.is_moe_layer(layer_id):
            return FeedForward(args.dim, args.ffn_hidden_dim)
        return MoE(args.dim, args.moe_hidden_dim, args.n_experts, args.top_k, args.norm_topk_prob)
