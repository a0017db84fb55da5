"""Qwen3-Next family (Gated DeltaNet hybrid with routed experts)."""

from temper.models.fit import check_hybrid_layout
from temper.models.qwen3_next.args import FLAVORS, Qwen3NextArgs
from temper.models.qwen3_next.hf import ADAPTER
from temper.models.qwen3_next.model import Qwen3NextTransformer
from temper.models.registry import ModelSpec, register_model

register_model(
    ModelSpec(
        "qwen3_next",
        FLAVORS,
        Qwen3NextTransformer,
        hf_adapter=ADAPTER,
        check_layout=check_hybrid_layout,
    )
)

__all__ = ["FLAVORS", "Qwen3NextArgs", "Qwen3NextTransformer"]
