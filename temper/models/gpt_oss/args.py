"""gpt-oss architecture arguments and the published sizes."""

from __future__ import annotations

from dataclasses import dataclass

from temper.models.layers.args import GQAArgs, MoEArgs, checked_layer_types
from temper.models.layers.rope import YarnScaling

LAYER_TYPES = ("sliding_attention", "full_attention")


def release_rope() -> YarnScaling:
    """Both releases' YaRN: 32x over a 4096-token original context, untruncated ramp."""
    return YarnScaling(
        factor=32.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
    )


@dataclass(kw_only=True)
class GptOssArgs(MoEArgs, GQAArgs):
    """Shapes and constants of a gpt-oss model: every block is GQA attention with biases and
    sinks, sliding-window or full (``layer_types``), then a routed MoE (no dense MLP).
    ``moe_hidden_dim`` is HF's ``intermediate_size``."""

    sliding_window: int = 128
    layer_types: tuple[str, ...] = ()
    """Per layer ``sliding_attention`` or ``full_attention``; empty: alternate, sliding first
    (transformers' default and both releases)."""
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    max_seq_len: int = 131072
    attention_bias: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.layer_types:
            self.layer_types = tuple(LAYER_TYPES[i % 2] for i in range(self.n_layers))
        self.layer_types = checked_layer_types(self.layer_types, self.n_layers, LAYER_TYPES)
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window {self.sliding_window} must be >= 1")

    def window(self, layer_id: int) -> int | None:
        """The attention window of layer ``layer_id`` (None: full causal attention)."""
        return self.sliding_window if self.layer_types[layer_id] == "sliding_attention" else None

    @property
    def rope_scale(self) -> float:
        """YaRN's attention factor on cos and sin (1 without scaling)."""
        return 1.0 if self.rope_scaling is None else self.rope_scaling.rope_scale()


def _published(n_layers: int, n_experts: int) -> GptOssArgs:
    """gpt-oss-20b and -120b differ only in depth and expert count."""
    return GptOssArgs(
        dim=2880,
        n_layers=n_layers,
        n_heads=64,
        n_kv_heads=8,
        head_dim=64,
        vocab_size=201088,
        n_experts=n_experts,
        top_k=4,
        moe_hidden_dim=2880,
        rope_scaling=release_rope(),
    )


FLAVORS: dict[str, GptOssArgs] = {
    # Holds the built-in tokenizer and trains on a CPU; a 16-token window so that the
    # sliding layers differ from the full ones at the tests' 32-64 tokens.
    "debug": GptOssArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=2,
        head_dim=32,
        vocab_size=2048,
        n_experts=8,
        top_k=2,
        moe_hidden_dim=256,
        sliding_window=16,
        rope_scaling=release_rope(),
        max_seq_len=2048,
    ),
    "20b": _published(n_layers=24, n_experts=32),
    "120b": _published(n_layers=36, n_experts=128),
}
