"""GLM-5: DeepSeek V3.2's model, its indexer rotating interleaved pairs."""

from __future__ import annotations

from temper.models.deepseek_v32.model import DeepseekV32Transformer


class GlmMoeDsaTransformer(DeepseekV32Transformer):
    """As DeepSeek V3.2; only the indexer's rotary layout differs."""

    index_rope_interleaved = True
