"""GLM-5: DeepSeek V3.2's model, its indexer rotating interleaved pairs, and layers that may
reuse the previous indexed layer's top-k."""

from __future__ import annotations

from temper.models.deepseek_v32.model import DeepseekV32Transformer
from temper.models.glm_moe_dsa.args import GlmMoeDsaArgs


class GlmMoeDsaTransformer(DeepseekV32Transformer):
    """As DeepSeek V3.2, but the indexer's rotary is in pairs, and a ``shared`` layer
    (``indexer_types``) attends to the keys chosen by the latest layer with an indexer (the
    decoder passes them on from that block's outputs)."""

    args: GlmMoeDsaArgs
    index_rope_interleaved = True
