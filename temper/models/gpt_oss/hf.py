"""gpt-oss <-> Hugging Face `GptOssForCausalLM`: config fields and the weight-name table.

transformers keeps gpt-oss's experts fused and stacked (`mlp.experts.gate_up_proj`
[E, dim, 2 * hidden], gate and up in alternating columns; `down_proj` [E, hidden, dim]), in
memory and on disk; the native experts use that layout, so every rule is one tensor to one
parameter. The released checkpoints store those two in MXFP4 (`*_blocks`, `*_scales`), which
loading dequantizes (`temper.models.mxfp4`); exports write the dequantized tensors.
"""

from __future__ import annotations

from typing import Any

from temper.models.gpt_oss.args import GptOssArgs
from temper.models.hf import HFAdapter, KeyRule, rope_from_hf, rope_to_hf

# Native name -> HF name within a block.
BLOCK_KEYS = {
    **{
        f"attention.w{p}.{t}": f"self_attn.{p}_proj.{t}"
        for p in ("q", "k", "v", "o")
        for t in ("weight", "bias")
    },
    "attention.sinks": "self_attn.sinks",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.router.gate.weight": "mlp.router.weight",
    "feed_forward.router.gate.bias": "mlp.router.bias",
    "feed_forward.experts.gate_up": "mlp.experts.gate_up_proj",
    "feed_forward.experts.gate_up_bias": "mlp.experts.gate_up_proj_bias",
    "feed_forward.experts.down": "mlp.experts.down_proj",
    "feed_forward.experts.down_bias": "mlp.experts.down_proj_bias",
}
QUANTIZATIONS = ("mxfp4",)
"""`quantization_config.quant_method`s that loading undoes (the experts' storage only)."""


def args_from_hf(config: dict[str, Any]) -> GptOssArgs:
    quant = (config.get("quantization_config") or {}).get("quant_method")
    if quant is not None and quant not in QUANTIZATIONS:
        raise ValueError(f"quantization {quant!r} is not supported ({', '.join(QUANTIZATIONS)} is)")
    if not config.get("attention_bias", True):
        raise ValueError("attention_bias false is not supported: gpt-oss projections have biases")
    theta, scaling = rope_from_hf(config, supported=("default", "yarn"))
    heads = config["num_attention_heads"]
    return GptOssArgs(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        vocab_size=config["vocab_size"],
        n_experts=config["num_local_experts"],
        top_k=config["num_experts_per_tok"],
        moe_hidden_dim=config["intermediate_size"],
        sliding_window=config.get("sliding_window") or 128,
        layer_types=tuple(config.get("layer_types") or ()),
        swiglu_alpha=config.get("swiglu_alpha", 1.702),
        swiglu_limit=config.get("swiglu_limit", 7.0),
        norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=config.get("tie_word_embeddings", False),
        max_seq_len=config.get("max_position_embeddings", 131072),
        router_aux_loss_coef=config.get("router_aux_loss_coef", 0.001),
    )


def args_to_hf(args: GptOssArgs) -> dict[str, Any]:
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "num_local_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "intermediate_size": args.moe_hidden_dim,
        "sliding_window": args.sliding_window,
        "layer_types": list(args.layer_types),
        "swiglu_alpha": args.swiglu_alpha,
        "swiglu_limit": args.swiglu_limit,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tie_embeddings,
        "max_position_embeddings": args.max_seq_len,
        "attention_bias": args.attention_bias,
        "router_aux_loss_coef": args.router_aux_loss_coef,
        **rope_to_hf(args.rope_theta, args.rope_scaling),
    }


def key_rules(args: GptOssArgs) -> list[KeyRule]:
    rules = [KeyRule("tok_embeddings.weight", ("model.embed_tokens.weight",))]
    for i in range(args.n_layers):
        block = BLOCK_KEYS.items()
        rules += [KeyRule(f"layers.{i}.{n}", (f"model.layers.{i}.{h}",)) for n, h in block]
    rules.append(KeyRule("norm.weight", ("model.norm.weight",)))
    if not args.tie_embeddings:
        rules.append(KeyRule("output.weight", ("lm_head.weight",)))
    return rules


ADAPTER = HFAdapter(
    model_types=("gpt_oss",),
    args_from_hf=args_from_hf,
    args_to_hf=args_to_hf,
    key_rules=key_rules,
)
