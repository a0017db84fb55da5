"""Hugging Face config fields and weight names of the Gated DeltaNet hybrids, which Qwen3-Next,
Qwen3.5 and Qwen3.5-MoE share; each family's ``hf.py`` states what differs (its model type,
its Gated DeltaNet projections, dense or MoE MLPs, plain or multimodal rotary)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from temper.models.hf import HFAdapter, KeyRule
from temper.models.hf_keys import (
    BLOCK_NORM_KEYS,
    QK_NORM_KEYS,
    ConfigNames,
    attention_keys,
    block_rules,
    decoder_rules,
    mlp_keys,
    router_rule,
    stacked_expert_rules,
)
from temper.models.layers.hybrid import HybridArgs, HybridMoeArgs, interval_layer_types

OWN_NAMES = {
    "linear_n_k_heads": "linear_num_key_heads",
    "linear_n_v_heads": "linear_num_value_heads",
    "linear_k_head_dim": "linear_key_head_dim",
    "linear_v_head_dim": "linear_value_head_dim",
    "linear_conv_kernel": "linear_conv_kernel_dim",
    "shared_expert_hidden_dim": "shared_expert_intermediate_size",
}
# The hybrids' transformers defaults beyond hf_keys.HF_DEFAULTS; ffn_hidden_dim 0: no dense MLP
# (Qwen3.5-MoE); no layer_types: from full_attention_interval.
DEFAULTS = {
    "ffn_hidden_dim": 0,
    "layer_types": (),
    "linear_conv_kernel": 4,
    "max_seq_len": 32768,
    "norm_topk_prob": True,
}


def hybrid_names(
    model_type: str,
    architecture: str,
    args_cls: type[HybridArgs],
    native_only: frozenset[str] = frozenset(),
) -> ConfigNames:
    """A hybrid family's config names: the shared table plus the Gated DeltaNet sizes and the
    shared expert; ``native_only``: fields its transformers config lacks."""
    return ConfigNames(
        model_type=model_type,
        architecture=architecture,
        args_cls=args_cls,
        own=OWN_NAMES,
        defaults=DEFAULTS,
        native_only=native_only,
        fallbacks={},
    )


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
SHARED_EXPERT_KEYS = {
    **mlp_keys("feed_forward.shared_experts", "mlp.shared_expert"),
    "feed_forward.shared_gate.weight": "mlp.shared_expert_gate.weight",
}


def hybrid_args_from_hf(config: dict[str, Any], names: ConfigNames, *, mrope: bool) -> Any:
    """The args of a (text) config; refuses settings the native model lacks."""
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope type {rope['rope_type']!r} is not supported (default is)")
    if mrope and rope.get("mrope_interleaved") is False:
        raise ValueError("mRoPE with contiguous (non-interleaved) sections is not supported")
    fields = names.read(config)
    fields["layer_types"] = fields["layer_types"] or interval_layer_types(
        fields["n_layers"], config.get("full_attention_interval", 4)
    )
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
    return names.args_cls(
        **fields,
        partial_rotary_factor=float(partial),
        mrope_section=tuple(rope.get("mrope_section") or (11, 11, 10)) if mrope else None,
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
    )


def hybrid_args_to_hf(args: HybridArgs, names: ConfigNames) -> dict[str, Any]:
    """config.json of a (text) hybrid: partial and multimodal rotary in `rope_parameters`,
    no `intermediate_size` without dense MLPs."""
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": args.rope_theta,
        "partial_rotary_factor": args.partial_rotary_factor,
    }
    if args.mrope_section is not None:
        rope.update(mrope_section=list(args.mrope_section), mrope_interleaved=True)
    config = {**names.write(args), "rope_parameters": rope}
    if not args.ffn_hidden_dim:
        del config["intermediate_size"]
    return config


def hybrid_rules(
    args: HybridArgs, grouped_projection: bool, mlp_rules: Callable[[int], list[KeyRule]]
) -> list[KeyRule]:
    """Embedding, blocks (token mixer by layer type, norms, then ``mlp_rules(layer_id)``),
    final norm and head."""
    projections = GROUPED_PROJECTION_KEYS if grouped_projection else SPLIT_PROJECTION_KEYS
    attention = {**attention_keys(args.attention_bias), **QK_NORM_KEYS}
    linear_attention = {**projections, **LINEAR_ATTENTION_KEYS}

    def block(i: int) -> list[KeyRule]:
        mixer = linear_attention if args.layer_types[i] == "linear_attention" else attention
        return block_rules(i, {**mixer, **BLOCK_NORM_KEYS}) + mlp_rules(i)

    return decoder_rules(args, block)


def dense_mlp_rules(layer_id: int) -> list[KeyRule]:
    return block_rules(layer_id, mlp_keys())


def moe_mlp_rules(args: HybridMoeArgs, layer_id: int) -> list[KeyRule]:
    """Router, shared expert and its gate, and each stacked expert weight over the n_experts
    per-expert HF tensors; a dense layer (``is_moe_layer`` False) has the dense names."""
    if not args.is_moe_layer(layer_id):
        return dense_mlp_rules(layer_id)
    shared = block_rules(layer_id, SHARED_EXPERT_KEYS)
    return [router_rule(layer_id), *shared, *stacked_expert_rules(layer_id, args.n_experts)]


def hybrid_adapter(names: ConfigNames, *, mrope: bool, grouped_projection: bool) -> HFAdapter:
    """A hybrid family's adapter: ``names``' config with plain or multimodal (``mrope``)
    rotary, split or grouped Gated DeltaNet projections, and MoE MLPs where its args route
    experts (dense SwiGLUs otherwise)."""

    def key_rules(args: HybridArgs) -> list[KeyRule]:
        if isinstance(args, HybridMoeArgs):
            return hybrid_rules(args, grouped_projection, lambda i: moe_mlp_rules(args, i))
        return hybrid_rules(args, grouped_projection, dense_mlp_rules)

    return HFAdapter(
        model_types=(names.model_type,),
        args_from_hf=lambda config: hybrid_args_from_hf(config, names, mrope=mrope),
        args_to_hf=lambda args: hybrid_args_to_hf(args, names),
        key_rules=key_rules,
    )
