"""Qwen3.5 (dense): the Gated DeltaNet hybrid skeleton with SwiGLU MLPs and mRoPE."""

from temper.models.layers.hybrid import HybridDecoder
from temper.models.qwen3_5.args import Qwen3_5Args


class Qwen3_5Transformer(HybridDecoder):
    """Qwen3.5 causal LM (the language model of Qwen3.5 checkpoints): three of four layers Gated
    DeltaNet (Qwen3.5's split projections), the fourth gated attention; every MLP dense."""

    args: Qwen3_5Args
