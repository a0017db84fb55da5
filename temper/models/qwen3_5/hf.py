"""Qwen3.5 (dense) <-> Hugging Face `Qwen3_5ForCausalLM` (model type `qwen3_5_text`)."""

from __future__ import annotations

from typing import Any

from temper.models.hf import HFAdapter, KeyRule
from temper.models.hf_hybrid import (
    dense_mlp_rules,
    hybrid_config_to_hf,
    hybrid_fields,
    hybrid_rules,
)
from temper.models.qwen3_5.args import Qwen3_5Args


def args_from_hf(config: dict[str, Any]) -> Qwen3_5Args:
    return Qwen3_5Args(**hybrid_fields(config, mrope=True))


def args_to_hf(args: Qwen3_5Args) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        **hybrid_config_to_hf(args),
    }


def key_rules(args: Qwen3_5Args) -> list[KeyRule]:
    return hybrid_rules(args, grouped_projection=False, mlp_rules=dense_mlp_rules)


ADAPTER = HFAdapter(
    model_types=("qwen3_5_text",),
    args_from_hf=args_from_hf,
    args_to_hf=args_to_hf,
    key_rules=key_rules,
)
