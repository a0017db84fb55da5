"""Qwen3.5 and Qwen3.5-MoE vision-language families (the released checkpoints' classes)."""

from temper.models.fit import check_hybrid_layout
from temper.models.qwen3_5_vl.args import FLAVORS, MOE_FLAVORS_VL, Qwen3_5MoeVLArgs, Qwen3_5VLArgs
from temper.models.qwen3_5_vl.hf import ADAPTER, MOE_ADAPTER
from temper.models.qwen3_5_vl.model import Qwen3_5MoeVLTransformer, Qwen3_5VLTransformer
from temper.models.registry import ModelSpec, register_model

register_model(
    ModelSpec(
        "qwen3_5_vl",
        FLAVORS,
        Qwen3_5VLTransformer,
        hf_adapter=ADAPTER,
        check_layout=check_hybrid_layout,
    )
)
register_model(
    ModelSpec(
        "qwen3_5_moe_vl",
        MOE_FLAVORS_VL,
        Qwen3_5MoeVLTransformer,
        hf_adapter=MOE_ADAPTER,
        check_layout=check_hybrid_layout,
    )
)

__all__ = [
    "FLAVORS",
    "MOE_FLAVORS_VL",
    "Qwen3_5MoeVLArgs",
    "Qwen3_5MoeVLTransformer",
    "Qwen3_5VLArgs",
    "Qwen3_5VLTransformer",
]
