"""Hugging Face config fields and weight names of the Gated DeltaNet hybrids, which Qwen3-Next,
Qwen3.5 and Qwen3.5-MoE share; each family's ``hf.py`` states what differs (its model type,
its Gated DeltaNet projections, dense or MoE MLPs, plain or multimodal rotary)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from temper.models.hf import KeyRule
from temper.models.layers.hybrid import HybridArgs, HybridMoeArgs, interval_layer_types

ATTENTION_KEYS = {
    "attention.wq.{}": "self_attn.q_proj.{}",
    "attention.wk.{}": "self_attn.k_proj.{}",
    "attention.wv.{}": "self_attn.v_proj.{}",
    "attention.wo.{}": "self_attn.o_proj.{}",
}
ATTENTION_NORM_KEYS = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
LINEAR_ATTENTION_KEYS = {
    "attention.conv_weight": "linear_attn.conv1d.weight",
    "attention.A_log": "linear_attn.A_log",
    "attention.dt_bias": "linear_attn.dt_bias",
    "attention.norm.weight": "linear_attn.norm.weight",
    "attention.wo.weight": "linear_attn.out_proj.weight",
}
# Qwen3.5's projections, and Qwen3-Next's fused ones.
SPLIT_PROJECTION_KEYS = {
    "attention.wqkv.weight": "linear_attn.in_proj_qkv.weight",
    "attention.wz.weight": "linear_attn.in_proj_z.weight",
    "attention.wb.weight": "linear_attn.in_proj_b.weight",
    "attention.wa.weight": "linear_attn.in_proj_a.weight",
}
GROUPED_PROJECTION_KEYS = {
    "attention.wqkvz.weight": "linear_attn.in_proj_qkvz.weight",
    "attention.wba.weight": "linear_attn.in_proj_ba.weight",
}
BLOCK_NORM_KEYS = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
MLP_KEYS = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
SHARED_EXPERT_KEYS = {
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
    "feed_forward.shared_gate.weight": "mlp.shared_expert_gate.weight",
}
EXPERT_KEYS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def hybrid_fields(config: dict[str, Any], *, mrope: bool) -> dict[str, Any]:
    """The HybridArgs fields of a (text) config; refuses settings the native model lacks."""
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (silu is)")
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope type {rope['rope_type']!r} is not supported (default is)")
    if mrope and rope.get("mrope_interleaved") is False:
        raise ValueError("mRoPE with contiguous (non-interleaved) sections is not supported")
    n_layers = config["num_hidden_layers"]
    layer_types = config.get("layer_types") or interval_layer_types(
        n_layers, config.get("full_attention_interval", 4)
    )
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
    return {
        "dim": config["hidden_size"],
        "n_layers": n_layers,
        "n_heads": config["num_attention_heads"],
        "n_kv_heads": config["num_key_value_heads"],
        "head_dim": config.get("head_dim")
        or config["hidden_size"] // config["num_attention_heads"],
        "vocab_size": config["vocab_size"],
        "ffn_hidden_dim": config.get("intermediate_size") or 0,
        "layer_types": tuple(layer_types),
        "linear_n_k_heads": config["linear_num_key_heads"],
        "linear_n_v_heads": config["linear_num_value_heads"],
        "linear_k_head_dim": config["linear_key_head_dim"],
        "linear_v_head_dim": config["linear_value_head_dim"],
        "linear_conv_kernel": config.get("linear_conv_kernel_dim", 4),
        "partial_rotary_factor": float(partial),
        "mrope_section": tuple(rope.get("mrope_section") or (11, 11, 10)) if mrope else None,
        "norm_eps": config.get("rms_norm_eps", 1e-6),
        "rope_theta": float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        "tie_embeddings": config.get("tie_word_embeddings", False),
        "max_seq_len": config.get("max_position_embeddings", 32768),
        "attention_bias": config.get("attention_bias", False),
    }


def moe_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The HybridMoeArgs fields beyond HybridArgs."""
    return {
        "n_experts": config["num_experts"],
        "top_k": config["num_experts_per_tok"],
        "moe_hidden_dim": config["moe_intermediate_size"],
        "shared_expert_hidden_dim": config["shared_expert_intermediate_size"],
        "norm_topk_prob": config.get("norm_topk_prob", True),
        "decoder_sparse_step": config.get("decoder_sparse_step", 1),
        "mlp_only_layers": tuple(config.get("mlp_only_layers") or ()),
        "router_aux_loss_coef": config.get("router_aux_loss_coef", 0.001),
    }


def hybrid_config_to_hf(args: HybridArgs) -> dict[str, Any]:
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": args.rope_theta,
        "partial_rotary_factor": args.partial_rotary_factor,
    }
    if args.mrope_section is not None:
        rope.update(mrope_section=list(args.mrope_section), mrope_interleaved=True)
    config = {
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "layer_types": list(args.layer_types),
        "linear_num_key_heads": args.linear_n_k_heads,
        "linear_num_value_heads": args.linear_n_v_heads,
        "linear_key_head_dim": args.linear_k_head_dim,
        "linear_value_head_dim": args.linear_v_head_dim,
        "linear_conv_kernel_dim": args.linear_conv_kernel,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": args.attention_bias,
        "rope_parameters": rope,
    }
    if args.ffn_hidden_dim:
        config["intermediate_size"] = args.ffn_hidden_dim
    return config


def moe_config_to_hf(args: HybridMoeArgs) -> dict[str, Any]:
    return {
        "num_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.moe_hidden_dim,
        "shared_expert_intermediate_size": args.shared_expert_hidden_dim,
        "router_aux_loss_coef": args.router_aux_loss_coef,
    }


def hybrid_rules(
    args: HybridArgs, *, grouped_projection: bool, mlp_rules: Callable[[int], list[KeyRule]]
) -> list[KeyRule]:
    """Embedding, blocks (token mixer by layer type, norms, then ``mlp_rules(layer_id)``),
    final norm and head."""
    rules = [KeyRule("tok_embeddings.weight", ("model.embed_tokens.weight",))]
    projections = GROUPED_PROJECTION_KEYS if grouped_projection else SPLIT_PROJECTION_KEYS
    params = ("weight", "bias") if args.attention_bias else ("weight",)
    for i, layer_type in enumerate(args.layer_types):
        if layer_type == "linear_attention":
            block = {**projections, **LINEAR_ATTENTION_KEYS}
        else:
            block = {n.format(p): h.format(p) for n, h in ATTENTION_KEYS.items() for p in params}
            block.update(ATTENTION_NORM_KEYS)
        block.update(BLOCK_NORM_KEYS)
        rules += [KeyRule(f"layers.{i}.{n}", (f"model.layers.{i}.{h}",)) for n, h in block.items()]
        rules += mlp_rules(i)
    rules.append(KeyRule("norm.weight", ("model.norm.weight",)))
    if not args.tie_embeddings:
        rules.append(KeyRule("output.weight", ("lm_head.weight",)))
    return rules


def dense_mlp_rules(layer_id: int) -> list[KeyRule]:
    return [
        KeyRule(f"layers.{layer_id}.{native}", (f"model.layers.{layer_id}.{hf}",))
        for native, hf in MLP_KEYS.items()
    ]


def moe_mlp_rules(args: HybridMoeArgs, layer_id: int) -> list[KeyRule]:
    """Router, shared expert and its gate, and each stacked expert weight over the n_experts
    per-expert HF tensors; a dense layer (``is_moe_layer`` False) has the dense names."""
    if not args.is_moe_layer(layer_id):
        return dense_mlp_rules(layer_id)
    native, hf = f"layers.{layer_id}", f"model.layers.{layer_id}"
    rules = [KeyRule(f"{native}.{n}", (f"{hf}.{h}",)) for n, h in SHARED_EXPERT_KEYS.items()]
    for w, proj in EXPERT_KEYS.items():
        experts = tuple(f"{hf}.mlp.experts.{e}.{proj}.weight" for e in range(args.n_experts))
        rules.append(KeyRule(f"{native}.feed_forward.experts.{w}", experts))
    return rules
