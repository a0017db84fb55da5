"""Qwen3 (dense) architecture arguments and the published sizes."""

from dataclasses import dataclass

from temper.models.layers.args import GQAArgs


@dataclass(kw_only=True)
class Qwen3Args(GQAArgs):
    """Shapes and constants of a Qwen3 model.

    ``head_dim`` is a setting of its own (128 in every published size), not ``dim // n_heads``.
    """

    ffn_hidden_dim: int
    rope_theta: float = 1000000.0
    max_seq_len: int = 40960


def _published(
    dim: int, n_layers: int, n_heads: int, ffn_hidden_dim: int, tie_embeddings: bool
) -> Qwen3Args:
    """Every published Qwen3 size shares vocab, head_dim, 8 kv heads, rope and norm settings."""
    return Qwen3Args(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        head_dim=128,
        vocab_size=151936,
        ffn_hidden_dim=ffn_hidden_dim,
        tie_embeddings=tie_embeddings,
    )


FLAVORS: dict[str, Qwen3Args] = {
    # Holds the built-in tokenizer (<= 2048 tokens) and trains on a laptop CPU; head_dim 64 is
    # deliberately unlike dim / n_heads = 32, as in the published sizes.
    "debug": Qwen3Args(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=64,
        vocab_size=2048,
        ffn_hidden_dim=768,
        rope_theta=10000.0,
        tie_embeddings=True,
        max_seq_len=2048,
    ),
    "0.6b": _published(1024, 28, 16, 3072, tie_embeddings=True),
    "1.7b": _published(2048, 28, 16, 6144, tie_embeddings=True),
    "4b": _published(2560, 36, 32, 9728, tie_embeddings=True),
    "8b": _published(4096, 36, 32, 12288, tie_embeddings=False),
    "14b": _published(5120, 40, 40, 17408, tie_embeddings=False),
    "32b": _published(5120, 64, 64, 25600, tie_embeddings=False),
}
