"""Qwen3.5-MoE <-> Hugging Face `Qwen3_5MoeForCausalLM` (model type `qwen3_5_moe_text`)."""

from __future__ import annotations

from typing import Any

from temper.models.hf import HFAdapter, KeyRule
from temper.models.hf_hybrid import (
    hybrid_config_to_hf,
    hybrid_fields,
    hybrid_rules,
    moe_config_to_hf,
    moe_fields,
    moe_mlp_rules,
)
from temper.models.qwen3_5_moe.args import Qwen3_5MoeArgs


def args_from_hf(config: dict[str, Any]) -> Qwen3_5MoeArgs:
    # Every layer is sparse and the router always renormalizes its top k.
    fields = moe_fields(config) | {"norm_topk_prob": True, "decoder_sparse_step": 1}
    return Qwen3_5MoeArgs(**hybrid_fields(config, mrope=True), **fields)


def args_to_hf(args: Qwen3_5MoeArgs) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        **hybrid_config_to_hf(args),
        **moe_config_to_hf(args),
    }


def key_rules(args: Qwen3_5MoeArgs) -> list[KeyRule]:
    return hybrid_rules(args, grouped_projection=False, mlp_rules=lambda i: moe_mlp_rules(args, i))


ADAPTER = HFAdapter(
    model_types=("qwen3_5_moe_text",),
    args_from_hf=args_from_hf,
    args_to_hf=args_to_hf,
    key_rules=key_rules,
)
