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
from temper.models.hf import HFAdapter, KeyRule
from temper.models.hf_keys import (
    BLOCK_NORM_KEYS,
    SILU,
    ConfigNames,
    attention_keys,
    uniform_rules,
)

CONFIG = ConfigNames(
    model_type="gpt_oss",
    architecture="GptOssForCausalLM",
    args_cls=GptOssArgs,
    own={n: n for n in ("sliding_window", "swiglu_alpha", "swiglu_limit")},
    # GptOssConfig's experts are num_local_experts of intermediate_size.
    aliases={"n_experts": "num_local_experts", "moe_hidden_dim": "intermediate_size"},
    defaults={
        "sliding_window": 128,
        "layer_types": (),
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "norm_eps": 1e-5,
        "max_seq_len": 131072,
        "attention_bias": True,
    },
    # transformers' gpt-oss experts ignore hidden_act: written as the others, never refused.
    fixed={},
    rope_types=("default", "yarn"),
)
# Native name -> HF name within a block, besides the projections and block norms.
OWN_BLOCK_KEYS = {
    "attention.sinks": "self_attn.sinks",
    **BLOCK_NORM_KEYS,
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
    return CONFIG.args_from_hf(config)


def args_to_hf(args: GptOssArgs) -> dict[str, Any]:
    return CONFIG.args_to_hf(args) | SILU


def key_rules(args: GptOssArgs) -> list[KeyRule]:
    block = {**attention_keys(bias=True), **OWN_BLOCK_KEYS}
    return uniform_rules(args, block)


ADAPTER = HFAdapter(
    model_types=("gpt_oss",),
    args_from_hf=args_from_hf,
    args_to_hf=args_to_hf,
    key_rules=key_rules,
)
