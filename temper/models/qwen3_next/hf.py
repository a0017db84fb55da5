"""Qwen3-Next <-> Hugging Face `Qwen3NextForCausalLM` (model type `qwen3_next`)."""

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
from temper.models.qwen3_next.args import Qwen3NextArgs


def args_from_hf(config: dict[str, Any]) -> Qwen3NextArgs:
    return Qwen3NextArgs(**hybrid_fields(config, mrope=False), **moe_fields(config))


def args_to_hf(args: Qwen3NextArgs) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        **hybrid_config_to_hf(args),
        **moe_config_to_hf(args),
        "norm_topk_prob": args.norm_topk_prob,
        "decoder_sparse_step": args.decoder_sparse_step,
        "mlp_only_layers": list(args.mlp_only_layers),
    }


def key_rules(args: Qwen3NextArgs) -> list[KeyRule]:
    return hybrid_rules(args, grouped_projection=True, mlp_rules=lambda i: moe_mlp_rules(args, i))


ADAPTER = HFAdapter(
    model_types=("qwen3_next",),
    args_from_hf=args_from_hf,
    args_to_hf=args_to_hf,
    key_rules=key_rules,
)
