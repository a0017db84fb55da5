"""GLM-5 (`glm_moe_dsa`) arguments and sizes: DeepSeek V3.2's, plus which layers reuse the
previous layer's top-k instead of running an indexer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from temper.models.deepseek_v32.args import FLAVORS as V32_FLAVORS
from temper.models.deepseek_v32.args import DeepseekV32Args

IndexerType = Literal["full", "shared"]


@dataclass(kw_only=True)
class GlmMoeDsaArgs(DeepseekV32Args):
    """DeepSeek V3.2's arguments; the indexer rotates interleaved pairs (the model's)."""

    indexer_types: tuple[IndexerType, ...] = ()
    """Per layer: ``full`` runs its own indexer, ``shared`` attends to the keys the latest
    full layer chose (GLM's cross-layer top-k sharing; the layer holds no indexer). Empty:
    every layer full."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.indexer_types:
            return
        if len(self.indexer_types) != self.n_layers:
            raise ValueError(
                f"indexer_types has {len(self.indexer_types)} entries for {self.n_layers} layers"
            )
        unknown = sorted(set(self.indexer_types) - {"full", "shared"})
        if unknown:
            raise ValueError(f"indexer_types {unknown[0]!r} is not 'full' or 'shared'")
        if self.indexer_types[0] != "full":
            raise ValueError(
                "indexer_types[0] must be 'full': a shared layer reuses an earlier one"
            )

    def has_indexer(self, layer_id: int) -> bool:
        return not self.indexer_types or self.indexer_types[layer_id] == "full"


def as_glm(args: DeepseekV32Args) -> GlmMoeDsaArgs:
    """DeepSeek V3.2 ``args`` as GLM-5's, every layer with its own indexer."""
    return GlmMoeDsaArgs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)})


FLAVORS: dict[str, GlmMoeDsaArgs] = {
    "debug": as_glm(V32_FLAVORS["debug"]),
    # GLM-5: transformers' GlmMoeDsaConfig defaults (its documented checkpoint zai-org/GLM-5),
    # rope at that class's default theta; 78 layers, the first 3 dense, every layer indexed.
    "744b": GlmMoeDsaArgs(
        dim=6144,
        n_layers=78,
        n_heads=64,
        vocab_size=154880,
        ffn_hidden_dim=12288,
        q_lora_rank=2048,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        n_dense_layers=3,
        n_experts=256,
        n_shared_experts=1,
        top_k=8,
        moe_hidden_dim=2048,
        n_groups=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_eps=1e-5,
        max_seq_len=202752,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=2048,
    ),
}
