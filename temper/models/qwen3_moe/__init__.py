"""Qwen3-MoE family."""

from temper.models.qwen3_moe.args import FLAVORS, Qwen3MoeArgs
from temper.models.qwen3_moe.hf import ADAPTER
from temper.models.qwen3_moe.model import Qwen3MoeTransformer
from temper.models.registry import ModelSpec, register_model

register_model(ModelSpec("qwen3_moe", FLAVORS, Qwen3MoeTransformer, hf_adapter=ADAPTER))

__all__ = ["FLAVORS", "Qwen3MoeArgs", "Qwen3MoeTransformer"]
