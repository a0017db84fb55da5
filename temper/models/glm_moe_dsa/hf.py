"""GLM-5 <-> Hugging Face `GlmMoeDsaForCausalLM`: DeepSeek V3.2's names and table under
another model type and defaults, plus ``indexer_types``.

transformers lets a layer reuse the previous indexed layer's top-k (``"shared"``); a config
says which either as ``indexer_types``, or as ``index_topk_pattern`` (``F``/``S`` per layer),
or as every ``index_topk_freq``-th layer being full from layer ``index_skip_topk_offset - 1``
on (defaults 1 and 2: every layer full). Exports write ``indexer_types``; shared layers
hold no indexer tensors.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from temper.models.deepseek_v32 import hf as v32
from temper.models.glm_moe_dsa.args import GlmMoeDsaArgs
from temper.models.hf import HFAdapter

CONFIG = dataclasses.replace(
    v32.CONFIG,
    model_type="glm_moe_dsa",
    architecture="GlmMoeDsaForCausalLM",
    args_cls=GlmMoeDsaArgs,
    # GlmMoeDsaConfig's defaults where they differ from DeepseekV32Config's.
    defaults={
        **v32.CONFIG.defaults,
        "q_lora_rank": 2048,
        "norm_eps": 1e-5,
        "max_seq_len": 202752,
        "index_n_heads": 32,
    },
)

LETTERS = {"F": "full", "S": "shared"}


def indexer_types_of(config: dict[str, Any]) -> list[str]:
    """Each layer's ``full``/``shared`` as transformers' config derives it (module
    docstring)."""
    if config.get("indexer_types") is not None:
        return list(config["indexer_types"])
    pattern = config.get("index_topk_pattern")
    if pattern is not None:
        return [LETTERS[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq = max(config.get("index_topk_freq") or 1, 1)
    offset = config.get("index_skip_topk_offset", 2)
    full = [max(i - offset + 1, 0) % freq == 0 for i in range(config["num_hidden_layers"])]
    return ["full" if f else "shared" for f in full]


def args_from_hf(config: dict[str, Any]) -> GlmMoeDsaArgs:
    args = v32.dsa_args_from_hf(CONFIG, config)
    types = indexer_types_of(config)
    if all(t == "full" for t in types):
        return args
    return dataclasses.replace(args, indexer_types=tuple(types))


def args_to_hf(args: GlmMoeDsaArgs) -> dict[str, Any]:
    types = list(args.indexer_types) or ["full"] * args.n_layers
    return CONFIG.args_to_hf(args) | {
        "num_key_value_heads": args.n_kv_heads,
        "indexer_types": types,
    }


ADAPTER = HFAdapter(
    model_types=("glm_moe_dsa",),
    args_from_hf=args_from_hf,
    args_to_hf=args_to_hf,
    key_rules=v32.key_rules,
    buffer_rules=v32.ADAPTER.buffer_rules,
)
