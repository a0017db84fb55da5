"""Llama 3 / 3.1 / 3.2 family."""

from temper.models.llama3.args import FLAVORS, LlamaArgs
from temper.models.llama3.hf import ADAPTER
from temper.models.llama3.model import Transformer
from temper.models.registry import ModelSpec, register_model

register_model(ModelSpec("llama3", FLAVORS, Transformer, hf_adapter=ADAPTER))

__all__ = ["FLAVORS", "LlamaArgs", "Transformer"]
