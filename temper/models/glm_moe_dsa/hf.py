"""GLM-5 <-> Hugging Face `GlmMoeDsaForCausalLM`: DeepSeek V3.2's names and table under
another model type and defaults.

transformers' class can let a layer reuse the previous layer's top-k (``indexer_types``
``"shared"``, from ``index_topk_pattern`` or ``index_topk_freq``); the native model runs an
indexer in every layer (the class's default), so such configs are refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from temper.models.deepseek_v32 import hf as v32
from temper.models.deepseek_v32.args import DeepseekV32Args
from temper.models.hf import HFAdapter

CONFIG = dataclasses.replace(
    v32.CONFIG,
    model_type="glm_moe_dsa",
    architecture="GlmMoeDsaForCausalLM",
    # GlmMoeDsaConfig's defaults where they differ from DeepseekV32Config's.
    defaults={
        **v32.CONFIG.defaults,
        "q_lora_rank": 2048,
        "norm_eps": 1e-5,
        "max_seq_len": 202752,
        "index_n_heads": 32,
    },
)


def check_every_layer_indexes(config: dict[str, Any]) -> None:
    shared = [i for i, t in enumerate(config.get("indexer_types") or ()) if t != "full"]
    pattern = config.get("index_topk_pattern")
    if shared or (pattern is not None and set(pattern) != {"F"} and set(pattern) != {"full"}):
        raise ValueError(
            f"indexer_types: layers {shared or pattern} reuse another layer's top-k, which is "
            "not supported (every layer 'full' is)"
        )
    if config.get("index_topk_freq") not in (None, 1):
        raise ValueError(f"index_topk_freq {config['index_topk_freq']} is not supported (1 is)")


def args_from_hf(config: dict[str, Any]) -> DeepseekV32Args:
    check_every_layer_indexes(config)
    return v32.dsa_args_from_hf(CONFIG, config)


def args_to_hf(args: DeepseekV32Args) -> dict[str, Any]:
    return CONFIG.args_to_hf(args) | {"num_key_value_heads": args.n_kv_heads}


ADAPTER = HFAdapter(
    model_types=("glm_moe_dsa",),
    args_from_hf=args_from_hf,
    args_to_hf=args_to_hf,
    key_rules=v32.key_rules,
    buffer_rules=v32.ADAPTER.buffer_rules,
)
