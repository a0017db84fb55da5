"""Every family's config survives HF -> native -> HF: transformers' own config class, given
what an adapter writes for the args it read, holds the same settings as the tiny config it
started from, and reads back as the same args (`temper.models.hf_keys` names both ways)."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import (
    AutoConfig,
    DeepseekV3Config,
    DeepseekV4Config,
    DeepseekV32Config,
    GlmMoeDsaConfig,
    GptOssConfig,
    LlamaConfig,
    PretrainedConfig,
    Qwen3_5Config,
    Qwen3_5MoeConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

from temper.models.hf import find_hf_family
from temper.models.registry import all_model_specs

SHAPE = {
    "vocab_size": 96,
    "hidden_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 128,
}
ROUTED = {"num_experts_per_tok": 2, "moe_intermediate_size": 16, "router_aux_loss_coef": 0.02}
HYBRID = {
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 12,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 3,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
}
HYBRID_MOE = {**ROUTED, "num_experts": 4, "shared_expert_intermediate_size": 24}
VISION = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 4,
    "out_hidden_size": 48,
    "num_position_embeddings": 16,
}
TOKENS = {
    "image_token_id": 90,
    "video_token_id": 91,
    "vision_start_token_id": 92,
    "vision_end_token_id": 93,
}
DSA = {
    "intermediate_size": 80,
    "moe_intermediate_size": 16,
    "first_k_dense_replace": 2,
    "n_routed_experts": 8,
    "n_shared_experts": 2,
    "num_experts_per_tok": 3,
    "n_group": 4,
    "topk_group": 2,
    "q_lora_rank": 20,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 12,
    "qk_rope_head_dim": 8,
    "v_head_dim": 10,
    "index_n_heads": 3,
    "index_head_dim": 16,
    "index_topk": 5,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 16.0,
    "beta_slow": 2.0,
    "mscale": 0.9,
    "mscale_all_dim": 0.7,
}

# Settings away from the classes' defaults wherever a family models them.
CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(
        **SHAPE,
        intermediate_size=80,
        head_dim=16,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        rope_parameters=LLAMA3_ROPE,
    ),
    "qwen3": Qwen3Config(
        **SHAPE, intermediate_size=80, head_dim=16, attention_bias=True, tie_word_embeddings=True
    ),
    "qwen3_moe": Qwen3MoeConfig(
        **SHAPE,
        **ROUTED,
        intermediate_size=80,
        head_dim=16,
        num_experts=6,
        norm_topk_prob=True,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    ),
    "gpt_oss": GptOssConfig(
        **SHAPE,
        head_dim=16,
        num_local_experts=6,
        num_experts_per_tok=2,
        intermediate_size=24,
        router_aux_loss_coef=0.02,
        sliding_window=8,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        swiglu_limit=5.0,
        tie_word_embeddings=True,
        rope_parameters={**YARN, "truncate": False},
    ),
    "deepseek_v3": DeepseekV3Config(
        **(SHAPE | {"num_key_value_heads": 4}),
        intermediate_size=80,
        moe_intermediate_size=16,
        first_k_dense_replace=2,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
        norm_topk_prob=False,
        q_lora_rank=20,
        kv_lora_rank=16,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        rope_interleave=False,
        num_nextn_predict_layers=2,
        rope_parameters=YARN,
    ),
    "deepseek_v32": DeepseekV32Config(
        **(SHAPE | {"num_key_value_heads": 4}),
        **DSA,
        routed_scaling_factor=1.5,
        norm_topk_prob=False,
        rope_parameters=YARN,
    ),
    "deepseek_v4": DeepseekV4Config(
        **(SHAPE | {"num_key_value_heads": 1}),
        head_dim=16,
        partial_rotary_factor=0.5,
        q_lora_rank=20,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        n_shared_experts=2,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        hc_mult=3,
        sliding_window=32,
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=3,
        index_head_dim=16,
        index_topk=5,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "glm_moe_dsa": GlmMoeDsaConfig(
        **(SHAPE | {"num_key_value_heads": 4}),
        **DSA,
        indexer_types=["full", "shared", "full", "shared"],
    ),
    "qwen3_next": Qwen3NextConfig(
        **SHAPE,
        **HYBRID,
        **HYBRID_MOE,
        intermediate_size=40,
        norm_topk_prob=False,
        mlp_only_layers=[0],
        partial_rotary_factor=0.5,
    ),
    "qwen3_5_text": Qwen3_5TextConfig(**SHAPE, **HYBRID, intermediate_size=40),
    "qwen3_5_moe_text": Qwen3_5MoeTextConfig(**SHAPE, **HYBRID, **HYBRID_MOE),
    "qwen3_5": Qwen3_5Config(
        text_config={**SHAPE, **HYBRID, "intermediate_size": 40},
        vision_config=VISION,
        **TOKENS,
    ),
    "qwen3_5_moe": Qwen3_5MoeConfig(
        text_config={**SHAPE, **HYBRID, **HYBRID_MOE}, vision_config=VISION, **TOKENS
    ),
}


def test_every_family_with_an_adapter_has_a_case() -> None:
    read = {t for s in all_model_specs() if s.hf_adapter for t in s.hf_adapter.model_types}
    assert read == set(CONFIGS)


HUB_ONLY = {"scoring_func", "topk_method", "moe_layer_freq"}
"""DeepSeek V3's hub settings that its adapter writes and transformers' class does not hold."""


def _differences(written: dict[str, Any], config: PretrainedConfig, where: str = "") -> list[str]:
    """Where what the adapter wrote differs from ``config``'s settings (read as transformers
    reads them: aliases resolved, nested configs entered); a written dict (rope parameters)
    must hold every entry of the config's, and may spell out the defaults it left out."""
    differences = []
    for key, value in written.items():
        if key == "architectures" or key in HUB_ONLY:
            continue
        held = getattr(config, key)
        if isinstance(held, PretrainedConfig):
            differences += _differences(value, held, f"{where}{key}.")
        elif isinstance(held, dict):
            differences += _dict_differences(value, held, f"{where}{key}.")
        elif held != value:
            differences.append(f"{where}{key}: {held!r} -> {value!r}")
    return differences


def _dict_differences(written: dict[str, Any], held: dict[str, Any], where: str) -> list[str]:
    """The entries of ``held`` that ``written`` lacks or holds otherwise, nested dicts (DeepSeek
    V4's per-rotary ``rope_parameters``) entered alike."""
    differences = []
    for k, v in held.items():
        if isinstance(v, dict):
            differences += _dict_differences(written.get(k) or {}, v, f"{where}{k}.")
        elif written.get(k) != v:
            differences.append(f"{where}{k}: {v!r} -> {written.get(k)!r}")
    return differences


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_config_survives_hf_native_hf(model_type: str) -> None:
    config = CONFIGS[model_type]
    adapter = find_hf_family(config.to_dict(), model_type).hf_adapter
    args = adapter.args_from_hf(config.to_dict())
    written = adapter.args_to_hf(args)
    assert written["model_type"] == model_type
    assert _differences(written, config) == []
    # transformers reads what was written as the same config, and that as the same args.
    rebuilt = AutoConfig.for_model(**written)
    assert _differences(written, rebuilt) == []
    assert adapter.args_from_hf(rebuilt.to_dict()) == args
