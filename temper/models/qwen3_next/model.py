"""Qwen3-Next: the Gated DeltaNet hybrid skeleton with fused projections and MoE MLPs."""

from temper.models.layers.gated_deltanet import GroupedGatedDeltaNet
from temper.models.layers.hybrid import HybridMoeDecoder
from temper.models.qwen3_next.args import Qwen3NextArgs


class Qwen3NextTransformer(HybridMoeDecoder):
    """Qwen3-Next causal LM: Gated DeltaNet with per-key-head fused q/k/v/z and b/a projections,
    gated attention with plain partial rotary, gated-shared-expert MoE MLPs."""

    args: Qwen3NextArgs
    linear_attention_cls = GroupedGatedDeltaNet
