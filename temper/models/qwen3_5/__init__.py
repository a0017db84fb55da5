"""Qwen3.5 dense family (Gated DeltaNet hybrid)."""

from temper.models.fit import check_hybrid_layout
from temper.models.qwen3_5.args import FLAVORS, Qwen3_5Args
from temper.models.qwen3_5.hf import ADAPTER
from temper.models.qwen3_5.model import Qwen3_5Transformer
from temper.models.registry import ModelSpec, register_model

register_model(
    ModelSpec(
        "qwen3_5", FLAVORS, Qwen3_5Transformer, hf_adapter=ADAPTER, check_layout=check_hybrid_layout
    )
)

__all__ = ["FLAVORS", "Qwen3_5Args", "Qwen3_5Transformer"]
