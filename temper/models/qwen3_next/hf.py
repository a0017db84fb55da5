"""Qwen3-Next <-> Hugging Face `Qwen3NextForCausalLM` (model type `qwen3_next`)."""

from __future__ import annotations

from temper.models.hf_hybrid import hybrid_adapter, hybrid_names
from temper.models.qwen3_next.args import Qwen3NextArgs

CONFIG = hybrid_names("qwen3_next", "Qwen3NextForCausalLM", Qwen3NextArgs)
ADAPTER = hybrid_adapter(CONFIG, mrope=False, grouped_projection=True)
