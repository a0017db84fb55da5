"""Qwen3 <-> Hugging Face `Qwen3ForCausalLM`: config fields and the weight-name table.

Qwen3-MoE reuses all of it and adds its experts (`temper.models.qwen3_moe.hf`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from temper.models.hf import HFAdapter, KeyRule, decoder_config_to_hf, rope_from_hf
from temper.models.qwen3.args import Qwen3Args

# Native name -> HF name within a block; "{}" is weight or bias.
ATTENTION_KEYS = {
    "attention.wq.{}": "self_attn.q_proj.{}",
    "attention.wk.{}": "self_attn.k_proj.{}",
    "attention.wv.{}": "self_attn.v_proj.{}",
    "attention.wo.{}": "self_attn.o_proj.{}",
}
NORM_KEYS = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
MLP_KEYS = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}


def dense_fields(config: dict[str, Any], default_head_dim: int) -> dict[str, Any]:
    """The Qwen3Args fields of an HF config; refuses settings the native model lacks."""
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (silu is)")
    if config.get("use_sliding_window") or "sliding_attention" in (config.get("layer_types") or []):
        raise ValueError("sliding-window attention is not supported")
    theta, scaling = rope_from_hf(config)
    return {
        "dim": config["hidden_size"],
        "n_layers": config["num_hidden_layers"],
        "n_heads": config["num_attention_heads"],
        "n_kv_heads": config.get("num_key_value_heads") or config["num_attention_heads"],
        "head_dim": config.get("head_dim") or default_head_dim,
        "vocab_size": config["vocab_size"],
        "ffn_hidden_dim": config["intermediate_size"],
        "norm_eps": config.get("rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "tie_embeddings": config.get("tie_word_embeddings", False),
        "max_seq_len": config.get("max_position_embeddings", 40960),
        "attention_bias": config.get("attention_bias", False),
    }


def args_from_hf(config: dict[str, Any]) -> Qwen3Args:
    # Qwen3Config's own default head_dim is 128, whatever hidden_size / heads is.
    return Qwen3Args(**dense_fields(config, default_head_dim=128))


def args_to_hf(args: Qwen3Args) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **decoder_config_to_hf(args),
        "use_sliding_window": False,
    }


def dense_mlp_rules(layer_id: int) -> list[KeyRule]:
    return [
        KeyRule(f"layers.{layer_id}.{native}", (f"model.layers.{layer_id}.{hf}",))
        for native, hf in MLP_KEYS.items()
    ]


def decoder_rules(args: Qwen3Args, mlp_rules: Callable[[int], list[KeyRule]]) -> list[KeyRule]:
    """Embedding, blocks (attention, norms, then ``mlp_rules(layer_id)``), final norm, head."""
    rules = [KeyRule("tok_embeddings.weight", ("model.embed_tokens.weight",))]
    params = ("weight", "bias") if args.attention_bias else ("weight",)
    for i in range(args.n_layers):
        block = {n.format(p): h.format(p) for n, h in ATTENTION_KEYS.items() for p in params}
        block.update(NORM_KEYS)
        rules += [KeyRule(f"layers.{i}.{n}", (f"model.layers.{i}.{h}",)) for n, h in block.items()]
        rules += mlp_rules(i)
    rules.append(KeyRule("norm.weight", ("model.norm.weight",)))
    if not args.tie_embeddings:
        rules.append(KeyRule("output.weight", ("lm_head.weight",)))
    return rules


def key_rules(args: Qwen3Args) -> list[KeyRule]:
    return decoder_rules(args, dense_mlp_rules)


ADAPTER = HFAdapter(
    model_types=("qwen3",),
    args_from_hf=args_from_hf,
    args_to_hf=args_to_hf,
    key_rules=key_rules,
)
