"""Qwen3-MoE architecture arguments and the published sizes."""

from dataclasses import dataclass

from temper.models.layers.args import SparseStepMoEArgs
from temper.models.qwen3.args import Qwen3Args


@dataclass(kw_only=True)
class Qwen3MoeArgs(SparseStepMoEArgs, Qwen3Args):
    """Qwen3 plus token-choice experts; ``ffn_hidden_dim`` sizes the dense layers, if any."""


def _published(
    dim: int, n_layers: int, n_heads: int, moe_hidden_dim: int, ffn_hidden_dim: int
) -> Qwen3MoeArgs:
    """Both published sizes: 128 experts, top 8, 4 kv heads of 128, every layer sparse."""
    return Qwen3MoeArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=4,
        head_dim=128,
        vocab_size=151936,
        ffn_hidden_dim=ffn_hidden_dim,
        n_experts=128,
        top_k=8,
        moe_hidden_dim=moe_hidden_dim,
        norm_topk_prob=True,
    )


FLAVORS: dict[str, Qwen3MoeArgs] = {
    # Holds the built-in tokenizer and trains on a CPU; layer 0 is dense, as mlp_only_layers
    # allows, so both MLP kinds train.
    "debug": Qwen3MoeArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=64,
        vocab_size=2048,
        ffn_hidden_dim=768,
        rope_theta=10000.0,
        max_seq_len=2048,
        n_experts=8,
        top_k=2,
        moe_hidden_dim=256,
        norm_topk_prob=True,
        mlp_only_layers=(0,),
    ),
    "30b_a3b": _published(2048, 48, 32, moe_hidden_dim=768, ffn_hidden_dim=6144),
    "235b_a22b": _published(4096, 94, 64, moe_hidden_dim=1536, ffn_hidden_dim=12288),
}
