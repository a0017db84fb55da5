"""GLM-5 family (`glm_moe_dsa`): DeepSeek V3.2's architecture (MLA, MoE, DeepSeek Sparse
Attention) with its own sizes, the indexer's rotary in interleaved pairs, and layers that may
reuse the previous indexed layer's top-k."""

from temper.models.glm_moe_dsa.args import FLAVORS, GlmMoeDsaArgs
from temper.models.glm_moe_dsa.hf import ADAPTER
from temper.models.glm_moe_dsa.model import GlmMoeDsaTransformer
from temper.models.registry import ModelSpec, register_model

register_model(
    ModelSpec(
        "glm_moe_dsa",
        FLAVORS,
        GlmMoeDsaTransformer,
        hf_adapter=ADAPTER,
    )
)

__all__ = ["FLAVORS", "GlmMoeDsaArgs", "GlmMoeDsaTransformer"]
