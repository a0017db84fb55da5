"""Qwen3.5-MoE: the Gated DeltaNet hybrid skeleton with gated-shared-expert MoE MLPs."""

from temper.models.layers.hybrid import HybridMoeDecoder
from temper.models.qwen3_5_moe.args import Qwen3_5MoeArgs


class Qwen3_5MoeTransformer(HybridMoeDecoder):
    """Qwen3.5-MoE causal LM (the language model of Qwen3.5-MoE checkpoints): Qwen3.5's token
    mixers and mRoPE, an MoE with a sigmoid-gated shared expert in every layer."""

    args: Qwen3_5MoeArgs
