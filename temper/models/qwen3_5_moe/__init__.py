"""Qwen3.5-MoE family (Gated DeltaNet hybrid with routed experts)."""

from temper.models.fit import check_hybrid_layout
from temper.models.qwen3_5_moe.args import FLAVORS, Qwen3_5MoeArgs
from temper.models.qwen3_5_moe.hf import ADAPTER
from temper.models.qwen3_5_moe.model import Qwen3_5MoeTransformer
from temper.models.registry import ModelSpec, register_model

register_model(
    ModelSpec(
        "qwen3_5_moe",
        FLAVORS,
        Qwen3_5MoeTransformer,
        hf_adapter=ADAPTER,
        check_layout=check_hybrid_layout,
    )
)

__all__ = ["FLAVORS", "Qwen3_5MoeArgs", "Qwen3_5MoeTransformer"]
