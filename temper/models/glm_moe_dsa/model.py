"""GLM-5: DeepSeek V3.2's model, its indexer rotating interleaved pairs, and layers that may
reuse the previous indexed layer's top-k."""

from __future__ import annotations

from temper.models.deepseek_v32.model import DeepseekV32Transformer
from temper.models.glm_moe_dsa.args import GlmMoeDsaArgs
from temper.models.layers.sparse_attention import SharedSelection, SparseMLA


class GlmMoeDsaTransformer(DeepseekV32Transformer):
    """As DeepSeek V3.2, but the indexer's rotary is in pairs, and a ``shared`` layer
    (``indexer_types``) attends to the keys chosen by the latest layer with an indexer."""

    args: GlmMoeDsaArgs
    index_rope_interleaved = True

    def attention(self, layer_id: int) -> SparseMLA:
        # Layers are built in order: each indexed layer opens the selection its followers read.
        if self.args.has_indexer(layer_id):
            self._selection = SharedSelection()
        return self.sparse_mla(layer_id, self._selection)
