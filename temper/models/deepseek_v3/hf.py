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
from temper.models.hf import HFAdapter, KeyRule, rope_from_hf, rope_to_hf
from temper.models.qwen3.hf import MLP_KEYS, dense_mlp_rules
from temper.models.qwen3_moe.hf import moe_rules

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
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}

# Settings of hub configs that transformers' class ignores; other values would change the model.
FIXED = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}


def args_from_hf(config: dict[str, Any]) -> DeepseekV3Args:
    for key, value in FIXED.items():
        if config.get(key, value) != value:
            raise ValueError(f"{key} {config[key]!r} is not supported ({value!r} is)")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (silu is)")
    if config.get("attention_bias"):
        raise ValueError("attention_bias is not supported")
    heads = config["num_attention_heads"]
    if config.get("num_key_value_heads") not in (None, heads):
        raise ValueError(
            f"num_key_value_heads {config['num_key_value_heads']} must equal "
            f"num_attention_heads {heads}: MLA expands one key/value per query head"
        )
    theta, scaling = rope_from_hf(config, supported=("default", "yarn"))
    return DeepseekV3Args(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=heads,
        vocab_size=config["vocab_size"],
        ffn_hidden_dim=config["intermediate_size"],
        q_lora_rank=config.get("q_lora_rank"),
        kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"],
        n_dense_layers=config["first_k_dense_replace"],
        n_experts=config.get("n_routed_experts") or config["num_local_experts"],
        n_shared_experts=config["n_shared_experts"],
        top_k=config["num_experts_per_tok"],
        moe_hidden_dim=config["moe_intermediate_size"],
        n_groups=config["n_group"],
        topk_group=config["topk_group"],
        routed_scaling_factor=config["routed_scaling_factor"],
        norm_topk_prob=config.get("norm_topk_prob", True),
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_interleave=config.get("rope_interleave", True),
        tie_embeddings=config.get("tie_word_embeddings", False),
        max_seq_len=config.get("max_position_embeddings", 4096),
        mtp_depth=config.get("num_nextn_predict_layers") or 0,
    )


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
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "vocab_size": args.vocab_size,
        "intermediate_size": args.ffn_hidden_dim,
        "q_lora_rank": args.q_lora_rank,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "first_k_dense_replace": args.n_dense_layers,
        "n_routed_experts": args.n_experts,
        "n_shared_experts": args.n_shared_experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.moe_hidden_dim,
        "n_group": args.n_groups,
        "topk_group": args.topk_group,
        "routed_scaling_factor": args.routed_scaling_factor,
        "norm_topk_prob": args.norm_topk_prob,
        **FIXED,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "rope_interleave": args.rope_interleave,
        "num_nextn_predict_layers": args.mtp_depth,
        **rope_to_hf(args.rope_theta, args.rope_scaling),
    }


def shared_expert_rules(layer_id: int) -> list[KeyRule]:
    """The dense MLP's names one level down: `feed_forward.shared_experts.w1.weight` <->
    `mlp.shared_experts.gate_proj.weight`."""
    return [
        KeyRule(
            f"layers.{layer_id}.{n.replace('feed_forward.', 'feed_forward.shared_experts.')}",
            (f"model.layers.{layer_id}.{h.replace('mlp.', 'mlp.shared_experts.')}",),
        )
        for n, h in MLP_KEYS.items()
    ]


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
    rules = [KeyRule(f"layers.{i}.{n}", (f"model.layers.{i}.{h}",)) for n, h in block.items()]
    if args.is_moe_layer(i):
        return rules + moe_rules(args, i) + shared_expert_rules(i)
    return rules + dense_mlp_rules(i)


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
    rules.append(KeyRule("tok_embeddings.weight", ("model.embed_tokens.weight",)))
    rules.append(KeyRule("norm.weight", ("model.norm.weight",)))
    if not args.tie_embeddings:
        rules.append(KeyRule("output.weight", ("lm_head.weight",)))
    return rules


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
