"""DeepSeek V3.2 <-> Hugging Face `DeepseekV32ForCausalLM`: DeepSeek V3's config names and
weight table plus the indexer's (``self_attn.indexer.*`` in every layer, the same names on
both sides).

transformers' class always rotates interleaved pairs and has no MTP depths (it ignores the hub's
`model.layers.61`), so neither ``rope_interleave`` nor ``num_nextn_predict_layers`` is read or
written. Its ``mlp_layer_types`` must be ``first_k_dense_replace`` dense layers, then MoE.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from temper.models.deepseek_v3 import hf as v3
from temper.models.deepseek_v32.args import DeepseekV32Args
from temper.models.hf import HFAdapter, KeyRule
from temper.models.hf_keys import ConfigNames, block_rules

INDEXER_OWN = {name: name for name in ("index_n_heads", "index_head_dim", "index_topk")}

CONFIG = dataclasses.replace(
    v3.CONFIG,
    model_type="deepseek_v32",
    architecture="DeepseekV32ForCausalLM",
    args_cls=DeepseekV32Args,
    own={**v3.CONFIG.own, **INDEXER_OWN},
    # DeepseekV32Config's defaults.
    defaults={
        **v3.CONFIG.defaults,
        "q_lora_rank": 1536,
        "max_seq_len": 163840,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 2048,
    },
    native_only=v3.CONFIG.native_only
    | {"rope_interleave", "mtp_depth", "indexer_training", "indexer_loss_weight"},
)

INDEXER_KEYS = {
    f"attention.indexer.{name}": f"self_attn.indexer.{name}"
    for name in (
        "wq_b.weight",
        "wk.weight",
        "k_norm.weight",
        "k_norm.bias",
        "weights_proj.weight",
    )
}


def check_mlp_layer_types(config: dict[str, Any]) -> None:
    """transformers derives ``mlp_layer_types`` from ``first_k_dense_replace``; another
    pattern is refused."""
    n, dense = config["num_hidden_layers"], config.get("first_k_dense_replace", 3)
    expected = ["dense"] * min(dense, n) + ["sparse"] * max(n - dense, 0)
    held = config.get("mlp_layer_types")
    if held is not None and list(held) != expected:
        raise ValueError(
            f"mlp_layer_types {held} is not supported: the first first_k_dense_replace "
            f"({dense}) layers dense, the rest sparse is"
        )


def dsa_args_from_hf(config_names: ConfigNames, config: dict[str, Any]) -> Any:
    """``config_names``' args of a DSA config dict (DeepSeek V3's checks, then the MLP
    layout)."""
    check_mlp_layer_types(config)
    if "q_lora_rank" in config and config["q_lora_rank"] is None:
        raise ValueError("q_lora_rank is required (null): the indexer reads the query latent")
    heads = config["num_attention_heads"]
    if config.get("num_key_value_heads") not in (None, heads):
        raise ValueError(
            f"num_key_value_heads {config['num_key_value_heads']} must equal "
            f"num_attention_heads {heads}: MLA expands one key/value per query head"
        )
    return config_names.args_from_hf(config)


def args_from_hf(config: dict[str, Any]) -> DeepseekV32Args:
    return dsa_args_from_hf(CONFIG, config)


def args_to_hf(args: DeepseekV32Args) -> dict[str, Any]:
    return CONFIG.args_to_hf(args) | {"num_key_value_heads": args.n_kv_heads}


def key_rules(args: DeepseekV32Args) -> list[KeyRule]:
    """DeepSeek V3's rules, then the indexer of each layer that has one."""
    indexers = [
        rule
        for i in range(args.n_layers)
        if args.has_indexer(i)
        for rule in block_rules(i, INDEXER_KEYS)
    ]
    return v3.key_rules(args) + indexers


ADAPTER = HFAdapter(
    model_types=("deepseek_v32",),
    args_from_hf=args_from_hf,
    args_to_hf=args_to_hf,
    key_rules=key_rules,
    buffer_rules=v3.buffer_rules,
)
