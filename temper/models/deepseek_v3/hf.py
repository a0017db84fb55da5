"""DeepSeek V3 <-> Hugging Face `DeepseekV3ForCausalLM`: config fields and the weight-name table.

Hub checkpoints, and `save_pretrained` of transformers 5 (which fuses gate/up in memory),
hold one tensor per routed expert and projection (`mlp.experts.E.gate_proj.weight`), stacked
here as in Qwen3-MoE; the shared experts are one SwiGLU (`mlp.shared_experts.*`), and each MoE
layer's `mlp.gate.e_score_correction_bias` buffer is the native router's `expert_bias`.
Multi-token-prediction depths (`num_nextn_predict_layers`; `model.layers.61` of DeepSeek-V3)
are read and written as the hub holds them: layer `n_layers + k` is a full decoder layer plus
`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, and copies of the embedding
(`embed_tokens`) and head (`shared_head.head`), which the native model shares with the main
ones (loaded from the main tensors' keys last; written under both). transformers itself does
not read them, and writes `num_nextn_predict_layers: 1` (its default) into configs whose
folders hold no such layer, so a folder's depth is the count of those layers it holds
(`fit_to_folder`); `--model.mtp_depth` (`load_hf(..., overrides=...)`) asks for another,
any missing tensor then named. Exports write the count they hold.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from temper.models.deepseek_v3.args import DeepseekV3Args
from temper.models.hf import HFAdapter, KeyRule
from temper.models.hf_keys import (
    BLOCK_NORM_KEYS,
    EMBEDDING_RULE,
    SILU,
    ConfigNames,
    block_rules,
    head_rules,
    mlp_keys,
    router_rule,
    stacked_expert_rules,
)

# Settings of hub configs that transformers' class ignores; other values would change the model.
HUB_SETTINGS = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}

CONFIG = ConfigNames(
    model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    args_cls=DeepseekV3Args,
    own={
        "q_lora_rank": "q_lora_rank",
        "kv_lora_rank": "kv_lora_rank",
        "qk_nope_head_dim": "qk_nope_head_dim",
        "qk_rope_head_dim": "qk_rope_head_dim",
        "v_head_dim": "v_head_dim",
        "n_dense_layers": "first_k_dense_replace",
        "n_shared_experts": "n_shared_experts",
        "n_groups": "n_group",
        "topk_group": "topk_group",
        "routed_scaling_factor": "routed_scaling_factor",
        "rope_interleave": "rope_interleave",
        "mtp_depth": "num_nextn_predict_layers",
    },
    aliases={"n_experts": "n_routed_experts"},
    also_read={"n_experts": ("num_local_experts",)},
    # DeepseekV3Config's defaults; q_lora_rank None: queries without a latent.
    defaults={
        "q_lora_rank": None,
        "norm_topk_prob": True,
        "rope_interleave": True,
        "max_seq_len": 4096,
        "mtp_depth": 0,
    },
    # transformers' class computes no load-balancing loss: a native training setting.
    native_only=frozenset({"router_aux_loss_coef"}),
    fixed={**HUB_SETTINGS, **SILU, "attention_bias": False},
    rope_types=("default", "yarn"),
)

# Native name -> HF name within a block; queries come from one projection or from a latent.
PLAIN_Q_KEYS = {"attention.wq.weight": "self_attn.q_proj.weight"}
LATENT_Q_KEYS = {
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
}
ATTENTION_KEYS = {
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    **BLOCK_NORM_KEYS,
}
SHARED_EXPERT_KEYS = mlp_keys("feed_forward.shared_experts", "mlp.shared_experts")


def args_from_hf(config: dict[str, Any]) -> DeepseekV3Args:
    heads = config["num_attention_heads"]
    if config.get("num_key_value_heads") not in (None, heads):
        raise ValueError(
            f"num_key_value_heads {config['num_key_value_heads']} must equal "
            f"num_attention_heads {heads}: MLA expands one key/value per query head"
        )
    return CONFIG.args_from_hf(config)


def fit_to_folder(args: DeepseekV3Args, tensor_names: set[str]) -> DeepseekV3Args:
    """``num_nextn_predict_layers`` MTP depths only if the folder holds their layers: the
    depths whose `eh_proj` is there (transformers writes 1, its default, and saves none)."""
    depth = 0
    while depth < args.mtp_depth and mtp_marker(args, depth) in tensor_names:
        depth += 1
    return dataclasses.replace(args, mtp_depth=depth)


def mtp_marker(args: DeepseekV3Args, k: int) -> str:
    return f"model.layers.{args.n_layers + k}.eh_proj.weight"


def args_to_hf(args: DeepseekV3Args) -> dict[str, Any]:
    return CONFIG.args_to_hf(args) | {"num_key_value_heads": args.n_kv_heads}


# Native name within an MTP depth -> HF name within its layer.
MTP_KEYS = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}


def layer_rules(args: DeepseekV3Args, i: int) -> list[KeyRule]:
    """Decoder layer ``i``: MLA, norms, dense MLP or routed + shared experts."""
    block = {**(PLAIN_Q_KEYS if args.q_lora_rank is None else LATENT_Q_KEYS), **ATTENTION_KEYS}
    if not args.is_moe_layer(i):
        return block_rules(i, {**block, **mlp_keys()})
    experts = [router_rule(i), *stacked_expert_rules(i, args.n_experts)]
    return block_rules(i, block) + experts + block_rules(i, SHARED_EXPERT_KEYS)


def mtp_rules(args: DeepseekV3Args, rules_of_layer: list[KeyRule], k: int) -> list[KeyRule]:
    """MTP depth ``k`` (HF layer ``n_layers + k``): its own tensors, then its block's (the
    rules of that layer index, renamed into ``mtp.k.block``), then the shared embedding and
    head's copies, last so that loading ends on the main tensors' values."""
    layer = args.n_layers + k
    hf = f"model.layers.{layer}"
    rules = [KeyRule(f"mtp.{k}.{n}", (f"{hf}.{h}",)) for n, h in MTP_KEYS.items()]
    rules += [
        KeyRule(r.native.replace(f"layers.{layer}.", f"mtp.{k}.block.", 1), r.hf)
        for r in rules_of_layer
    ]
    head = "tok_embeddings.weight" if args.tie_embeddings else "output.weight"
    return rules + [
        KeyRule("tok_embeddings.weight", (f"{hf}.embed_tokens.weight",)),
        KeyRule(head, (f"{hf}.shared_head.head.weight",)),
    ]


def key_rules(args: DeepseekV3Args) -> list[KeyRule]:
    """Embedding, layers, MTP depths, norm, head (the main tensors last: see ``mtp_rules``)."""
    rules = []
    for i in range(args.n_layers):
        rules += layer_rules(args, i)
    for k in range(args.mtp_depth):
        rules += mtp_rules(args, layer_rules(args, args.n_layers + k), k)
    return [*rules, EMBEDDING_RULE, *head_rules(args)]


def _expert_bias_rule(i: int) -> KeyRule:
    return KeyRule(
        f"layers.{i}.feed_forward.router.expert_bias",
        (f"model.layers.{i}.mlp.gate.e_score_correction_bias",),
    )


def buffer_rules(args: DeepseekV3Args) -> list[KeyRule]:
    rules = [_expert_bias_rule(i) for i in range(args.n_layers) if args.is_moe_layer(i)]
    for k in range(args.mtp_depth):
        layer = args.n_layers + k
        if args.is_moe_layer(layer):
            rule = _expert_bias_rule(layer)
            native = rule.native.replace(f"layers.{layer}.", f"mtp.{k}.block.", 1)
            rules.append(KeyRule(native, rule.hf))
    return rules


ADAPTER = HFAdapter(
    model_types=("deepseek_v3",),
    args_from_hf=args_from_hf,
    args_to_hf=args_to_hf,
    key_rules=key_rules,
    buffer_rules=buffer_rules,
    fit_to_folder=fit_to_folder,
)
