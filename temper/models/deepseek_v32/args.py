"""DeepSeek V3.2 (DeepSeek V3 with DeepSeek Sparse Attention) arguments and published sizes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from temper.models.deepseek_v3.args import FLAVORS as V3_FLAVORS
from temper.models.deepseek_v3.args import DeepseekV3Args
from temper.models.layers.sparse_attention import INDEXER_TRAINING, IndexerTraining


@dataclass(kw_only=True)
class DeepseekV32Args(DeepseekV3Args):
    """DeepSeek V3's shapes plus the lightning indexer's (``temper.models.layers.
    sparse_attention``): each query attends to its ``index_topk`` best keys as scored by
    ``index_n_heads`` heads of ``index_head_dim`` (the first ``qk_rope_head_dim`` rotary)."""

    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_training: IndexerTraining = "off"
    """How the indexer trains: ``off`` (it does not: transformers' behaviour, the usual choice
    for fine-tuning a released model), ``sparse`` (attention over the selected keys, the
    indexer learning the main attention's distribution over them by a KL term) or
    ``dense_warmup`` (attention over every visible key, the indexer learning it; every other
    weight frozen). A training setting, not in HF configs."""
    indexer_loss_weight: float = 1.0
    """Weight of the indexer's KL term per token (its mean over layers and query positions)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.q_lora_rank is None:
            raise ValueError("q_lora_rank is required: the indexer reads the query latent")
        if not self.rope_interleave:
            raise ValueError("rope_interleave must be True: DSA models rotate interleaved pairs")
        if self.mtp_depth:
            raise ValueError(f"mtp_depth {self.mtp_depth}: DSA families have no MTP depths yet")
        if self.indexer_training not in INDEXER_TRAINING:
            raise ValueError(
                f"indexer_training {self.indexer_training!r} is not one of {INDEXER_TRAINING}"
            )
        if self.indexer_loss_weight < 0:
            raise ValueError(f"indexer_loss_weight {self.indexer_loss_weight} must be >= 0")
        for name in ("index_n_heads", "index_topk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be >= 1")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(
                f"index_head_dim {self.index_head_dim} must be >= qk_rope_head_dim "
                f"{self.qk_rope_head_dim}"
            )

    def has_indexer(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` runs its own indexer (every one here; see GLM-5's)."""
        return True


def with_indexer(
    args: DeepseekV3Args, index_n_heads: int, index_head_dim: int, index_topk: int
) -> DeepseekV32Args:
    """DeepSeek V3 ``args`` with an indexer: V3.2 is V3's architecture plus DSA."""
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    return DeepseekV32Args(
        **fields, index_n_heads=index_n_heads, index_head_dim=index_head_dim, index_topk=index_topk
    )


FLAVORS: dict[str, DeepseekV32Args] = {
    # DeepSeek V3's debug model with a 4-head indexer keeping 64 keys per query, so selection
    # matters from 65 tokens on.
    "debug": with_indexer(V3_FLAVORS["debug"], index_n_heads=4, index_head_dim=32, index_topk=64),
    # DeepSeek-V3.2-Exp: DeepSeek V3's 671B sizes and YaRN (transformers' DeepseekV32Config
    # defaults hold the same shapes) plus its indexer: 64 heads of 128, top 2048.
    "671b": with_indexer(V3_FLAVORS["671b"], index_n_heads=64, index_head_dim=128, index_topk=2048),
}
