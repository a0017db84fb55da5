"""Qwen3.5-MoE architecture arguments and sizes."""

from dataclasses import dataclass

from temper.models.layers.hybrid import HybridMoeArgs, interval_layer_types


@dataclass(kw_only=True)
class Qwen3_5MoeArgs(HybridMoeArgs):
    """A Gated DeltaNet hybrid whose every MLP is routed experts (top-k renormalized) plus a
    sigmoid-gated shared expert, with multimodal rotary sections."""

    mrope_section: tuple[int, int, int] | None = (11, 11, 10)


def _published(
    dim: int,
    n_layers: int,
    n_heads: int,
    linear_n_v_heads: int,
    n_experts: int,
    top_k: int,
    moe_hidden_dim: int,
) -> Qwen3_5MoeArgs:
    """The published sizes share vocab, 2 kv heads of 256, 16 key heads of 128, 1 layer in 4
    attention, and a shared expert as wide as a routed one."""
    return Qwen3_5MoeArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=2,
        head_dim=256,
        vocab_size=248320,
        ffn_hidden_dim=0,
        layer_types=interval_layer_types(n_layers),
        linear_n_k_heads=16,
        linear_n_v_heads=linear_n_v_heads,
        linear_k_head_dim=128,
        linear_v_head_dim=128,
        n_experts=n_experts,
        top_k=top_k,
        moe_hidden_dim=moe_hidden_dim,
        shared_expert_hidden_dim=moe_hidden_dim,
    )


FLAVORS: dict[str, Qwen3_5MoeArgs] = {
    # Holds the built-in tokenizer and trains on a CPU; layers 0-2 Gated DeltaNet, 3 attention.
    "debug": Qwen3_5MoeArgs(
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        vocab_size=2048,
        ffn_hidden_dim=0,
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
    ),
    # transformers' Qwen3_5MoeTextConfig defaults, which its docs name the 35B-A3B shape.
    "35b_a3b": _published(2048, 40, 16, 32, n_experts=256, top_k=8, moe_hidden_dim=512),
    # From the model card (not checked against the released config.json here: no network).
    "397b_a17b": _published(4096, 60, 32, 64, n_experts=512, top_k=10, moe_hidden_dim=1024),
}
