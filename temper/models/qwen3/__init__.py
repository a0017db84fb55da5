"""Qwen3 dense family."""

from temper.models.qwen3.args import FLAVORS, Qwen3Args
from temper.models.qwen3.hf import ADAPTER
from temper.models.qwen3.model import Qwen3Transformer
from temper.models.registry import ModelSpec, register_model

register_model(ModelSpec("qwen3", FLAVORS, Qwen3Transformer, hf_adapter=ADAPTER))

__all__ = ["FLAVORS", "Qwen3Args", "Qwen3Transformer"]
