"""Qwen3-Next architecture arguments and sizes."""

from dataclasses import dataclass

from temper.models.layers.hybrid import HybridMoeArgs, interval_layer_types


@dataclass(kw_only=True)
class Qwen3NextArgs(HybridMoeArgs):
    """A Gated DeltaNet hybrid (fused projections) with gated-shared-expert MoE MLPs where
    ``is_moe_layer``, and plain partial rotary."""


FLAVORS: dict[str, Qwen3NextArgs] = {
    # Holds the built-in tokenizer and trains on a CPU; layer 0 dense (mlp_only_layers) so
    # both MLP kinds train.
    "debug": Qwen3NextArgs(
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        vocab_size=2048,
        ffn_hidden_dim=256,
        layer_types=interval_layer_types(4),
        linear_n_k_heads=2,
        linear_n_v_heads=4,
        linear_k_head_dim=32,
        linear_v_head_dim=32,
        rope_theta=10000.0,
        max_seq_len=2048,
        n_experts=8,
        top_k=2,
        moe_hidden_dim=64,
        shared_expert_hidden_dim=64,
        mlp_only_layers=(0,),
    ),
    # transformers' Qwen3NextConfig defaults, which its docs name the 80B-A3B shape.
    "80b_a3b": Qwen3NextArgs(
        dim=2048,
        n_layers=48,
        n_heads=16,
        n_kv_heads=2,
        head_dim=256,
        vocab_size=151936,
        ffn_hidden_dim=5632,
        layer_types=interval_layer_types(48),
        linear_n_k_heads=16,
        linear_n_v_heads=32,
        linear_k_head_dim=128,
        linear_v_head_dim=128,
        n_experts=512,
        top_k=10,
        moe_hidden_dim=512,
        shared_expert_hidden_dim=512,
    ),
}
