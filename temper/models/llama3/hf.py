"""Llama 3 <-> Hugging Face `LlamaForCausalLM`: config fields and the weight-name table."""

from __future__ import annotations

from temper.models.hf import HFAdapter, KeyRule
from temper.models.hf_keys import (
    BLOCK_NORM_KEYS,
    ConfigNames,
    attention_keys,
    mlp_keys,
    uniform_rules,
)
from temper.models.llama3.args import LlamaArgs

CONFIG = ConfigNames(
    model_type="llama",
    architecture="LlamaForCausalLM",
    args_cls=LlamaArgs,
    # LlamaConfig's defaults beyond hf_keys.HF_DEFAULTS.
    defaults={
        "max_seq_len": 2048,
        "mlp_bias": False,
    },
)


def key_rules(args: LlamaArgs) -> list[KeyRule]:
    block = {
        **attention_keys(args.attention_bias),
        **mlp_keys(bias=args.mlp_bias),
        **BLOCK_NORM_KEYS,
    }
    return uniform_rules(args, block)


ADAPTER = HFAdapter(
    model_types=("llama",),
    args_from_hf=CONFIG.args_from_hf,
    args_to_hf=CONFIG.args_to_hf,
    key_rules=key_rules,
)
