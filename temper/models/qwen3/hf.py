"""Qwen3 <-> Hugging Face `Qwen3ForCausalLM`: config fields and the weight-name table."""

from __future__ import annotations

from typing import Any

from temper.models.hf import HFAdapter, KeyRule
from temper.models.hf_keys import (
    BLOCK_NORM_KEYS,
    QK_NORM_KEYS,
    SILU,
    ConfigNames,
    attention_keys,
    mlp_keys,
    uniform_rules,
)
from temper.models.qwen3.args import Qwen3Args

CONFIG = ConfigNames(
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    args_cls=Qwen3Args,
    # Qwen3Config's defaults: its head_dim is 128, whatever hidden_size / heads is.
    defaults={
        "max_seq_len": 40960,
        "head_dim": 128,
    },
    fixed={**SILU, "use_sliding_window": False},
)


def check_full_attention(config: dict[str, Any]) -> None:
    """Refuse sliding-window layers, which Qwen3's (and Qwen3-MoE's) native attention lacks."""
    if config.get("use_sliding_window") or "sliding_attention" in (config.get("layer_types") or []):
        raise ValueError("sliding-window attention is not supported")


def args_from_hf(config: dict[str, Any]) -> Qwen3Args:
    check_full_attention(config)
    return CONFIG.args_from_hf(config)


args_to_hf = CONFIG.args_to_hf


def attention_block(args: Qwen3Args) -> dict[str, str]:
    """A block's names but its MLP's: projections, q/k norms, block norms."""
    return {**attention_keys(args.attention_bias), **QK_NORM_KEYS, **BLOCK_NORM_KEYS}


def key_rules(args: Qwen3Args) -> list[KeyRule]:
    block = {**attention_block(args), **mlp_keys()}
    return uniform_rules(args, block)


ADAPTER = HFAdapter(
    model_types=("qwen3",),
    args_from_hf=args_from_hf,
    args_to_hf=args_to_hf,
    key_rules=key_rules,
)
