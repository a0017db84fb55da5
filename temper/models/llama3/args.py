"""Llama 3 architecture arguments and the published sizes."""

from dataclasses import dataclass

from temper.models.layers.args import GQAArgs
from temper.models.layers.rope import RopeScaling


@dataclass(kw_only=True)
class LlamaArgs(GQAArgs):
    """Shapes and constants of a Llama 3 model; ``head_dim`` 0 means ``dim // n_heads``."""

    ffn_hidden_dim: int
    mlp_bias: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 131072


_LLAMA_3_1_ROPE = RopeScaling(factor=8.0)
_LLAMA_3_2_ROPE = RopeScaling(factor=32.0)

FLAVORS: dict[str, LlamaArgs] = {
    # Holds the built-in tokenizer (<= 2048 tokens) and trains on a laptop CPU.
    "debug": LlamaArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=2048,
        ffn_hidden_dim=768,
        rope_theta=10000.0,
        max_seq_len=2048,
    ),
    "1b": LlamaArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden_dim=8192,
        rope_scaling=_LLAMA_3_2_ROPE,
        tie_embeddings=True,
    ),
    "3b": LlamaArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden_dim=8192,
        rope_scaling=_LLAMA_3_2_ROPE,
        tie_embeddings=True,
    ),
    "8b": LlamaArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden_dim=14336,
        rope_scaling=_LLAMA_3_1_ROPE,
    ),
    "70b": LlamaArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden_dim=28672,
        rope_scaling=_LLAMA_3_1_ROPE,
    ),
    "405b": LlamaArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden_dim=53248,
        rope_scaling=_LLAMA_3_1_ROPE,
    ),
}
