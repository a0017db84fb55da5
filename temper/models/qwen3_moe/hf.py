"""Qwen3-MoE <-> Hugging Face `Qwen3MoeForCausalLM`: Qwen3's names plus the experts.

Hub checkpoints, and `save_pretrained` of transformers 5 (which fuses gate/up in memory but
writes the per-expert layout back), hold one tensor per expert and projection; each native
stacked parameter is a `KeyRule` over the n_experts HF tensors in expert order.
"""

from __future__ import annotations

from typing import Any

from temper.models.hf import HFAdapter, KeyRule
from temper.models.hf_keys import (
    ConfigNames,
    block_rules,
    decoder_rules,
    mlp_keys,
    router_rule,
    stacked_expert_rules,
)
from temper.models.qwen3 import hf as qwen3_hf
from temper.models.qwen3_moe.args import Qwen3MoeArgs

CONFIG = ConfigNames(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    args_cls=Qwen3MoeArgs,
    # save_pretrained writes num_experts under its alias num_local_experts. Unlike
    # Qwen3Config, Qwen3MoeConfig has no head_dim default: hidden_size / heads (0 here).
    also_read={"n_experts": ("num_local_experts",)},
    defaults={
        **qwen3_hf.CONFIG.defaults,
        "head_dim": 0,
        "norm_topk_prob": False,
    },
    fixed=qwen3_hf.CONFIG.fixed,
)


def args_from_hf(config: dict[str, Any]) -> Qwen3MoeArgs:
    qwen3_hf.check_full_attention(config)
    return CONFIG.args_from_hf(config)


args_to_hf = CONFIG.args_to_hf


def key_rules(args: Qwen3MoeArgs) -> list[KeyRule]:
    attention = qwen3_hf.attention_block(args)

    def block(i: int) -> list[KeyRule]:
        if not args.is_moe_layer(i):
            return block_rules(i, {**attention, **mlp_keys()})
        return block_rules(i, attention) + [
            router_rule(i),
            *stacked_expert_rules(i, args.n_experts),
        ]

    return decoder_rules(args, block)


ADAPTER = HFAdapter(
    model_types=("qwen3_moe",),
    args_from_hf=args_from_hf,
    args_to_hf=CONFIG.args_to_hf,
    key_rules=key_rules,
)
