"""Qwen3.5 (dense) <-> Hugging Face `Qwen3_5ForCausalLM` (model type `qwen3_5_text`)."""

from __future__ import annotations

from temper.models.hf_hybrid import hybrid_adapter, hybrid_names
from temper.models.qwen3_5.args import Qwen3_5Args

CONFIG = hybrid_names("qwen3_5_text", "Qwen3_5ForCausalLM", Qwen3_5Args)
ADAPTER = hybrid_adapter(CONFIG, mrope=True, grouped_projection=False)
