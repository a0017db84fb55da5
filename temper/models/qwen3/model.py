"""Qwen3 decoder composed from the shared layers; HF-compatible numerics and weight layout."""

from temper.models.layers.decoder import Decoder
from temper.models.qwen3.args import Qwen3Args


class Qwen3Transformer(Decoder):
    """Qwen3 causal LM: the shared decoder with per-head q/k RMSNorm before rotary.

    Qwen3-MoE overrides ``feed_forward`` and nothing else structural.
    """

    args: Qwen3Args
    qk_norm = True
