"""Llama 3 <-> Hugging Face `LlamaForCausalLM`: config fields and the weight-name table."""

from __future__ import annotations

from typing import Any

from temper.models.hf import HFAdapter, KeyRule, decoder_config_to_hf, rope_from_hf
from temper.models.llama3.args import LlamaArgs

# Native name -> HF name for each block; "{}" is the layer index.
BLOCK_KEYS = {
    "attention.wq.{}": "self_attn.q_proj.{}",
    "attention.wk.{}": "self_attn.k_proj.{}",
    "attention.wv.{}": "self_attn.v_proj.{}",
    "attention.wo.{}": "self_attn.o_proj.{}",
    "feed_forward.w1.{}": "mlp.gate_proj.{}",
    "feed_forward.w3.{}": "mlp.up_proj.{}",
    "feed_forward.w2.{}": "mlp.down_proj.{}",
    "attention_norm.{}": "input_layernorm.{}",
    "ffn_norm.{}": "post_attention_layernorm.{}",
}


def args_from_hf(config: dict[str, Any]) -> LlamaArgs:
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (silu is)")
    theta, scaling = rope_from_hf(config)
    return LlamaArgs(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        vocab_size=config["vocab_size"],
        ffn_hidden_dim=config["intermediate_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=config.get("tie_word_embeddings", False),
        max_seq_len=config.get("max_position_embeddings", 2048),
        head_dim=config.get("head_dim") or 0,
        attention_bias=config.get("attention_bias", False),
        mlp_bias=config.get("mlp_bias", False),
    )


def args_to_hf(args: LlamaArgs) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **decoder_config_to_hf(args),
        "mlp_bias": args.mlp_bias,
    }


def key_rules(args: LlamaArgs) -> list[KeyRule]:
    rules = [KeyRule("tok_embeddings.weight", ("model.embed_tokens.weight",))]
    for i in range(args.n_layers):
        for native, hf in BLOCK_KEYS.items():
            params = ["weight"]
            if native.startswith("attention.w") and args.attention_bias:
                params.append("bias")
            if native.startswith("feed_forward") and args.mlp_bias:
                params.append("bias")
            rules += [
                KeyRule(f"layers.{i}." + native.format(p), (f"model.layers.{i}." + hf.format(p),))
                for p in params
            ]
    rules.append(KeyRule("norm.weight", ("model.norm.weight",)))
    if not args.tie_embeddings:
        rules.append(KeyRule("output.weight", ("lm_head.weight",)))
    return rules


ADAPTER = HFAdapter(
    model_types=("llama",),
    args_from_hf=args_from_hf,
    args_to_hf=args_to_hf,
    key_rules=key_rules,
)
