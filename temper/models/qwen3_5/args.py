"""Qwen3.5 (dense) architecture arguments and sizes."""

from dataclasses import dataclass

from temper.models.layers.hybrid import HybridArgs, interval_layer_types


@dataclass(kw_only=True)
class Qwen3_5Args(HybridArgs):
    """A Gated DeltaNet hybrid with SwiGLU MLPs and multimodal rotary sections (text positions
    use all three axes alike)."""

    mrope_section: tuple[int, int, int] | None = (11, 11, 10)


FLAVORS: dict[str, Qwen3_5Args] = {
    # Holds the built-in tokenizer and trains on a CPU: layers 0-2 Gated DeltaNet, 3 attention;
    # 4 value heads on 2 key heads, as the published sizes group them.
    "debug": Qwen3_5Args(
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        vocab_size=2048,
        ffn_hidden_dim=384,
        layer_types=interval_layer_types(4),
        linear_n_k_heads=2,
        linear_n_v_heads=4,
        linear_k_head_dim=32,
        linear_v_head_dim=32,
        rope_theta=10000.0,
        max_seq_len=2048,
    ),
    # transformers' Qwen3_5TextConfig defaults, which its docs name the Qwen3.5-9B shape.
    "9b": Qwen3_5Args(
        dim=4096,
        n_layers=32,
        n_heads=16,
        n_kv_heads=4,
        head_dim=256,
        vocab_size=248320,
        ffn_hidden_dim=12288,
        layer_types=interval_layer_types(32),
        linear_n_k_heads=16,
        linear_n_v_heads=32,
        linear_k_head_dim=128,
        linear_v_head_dim=128,
    ),
}
