"""Qwen3.5-MoE <-> Hugging Face `Qwen3_5MoeForCausalLM` (model type `qwen3_5_moe_text`)."""

from __future__ import annotations

from temper.models.hf_hybrid import hybrid_adapter, hybrid_names
from temper.models.qwen3_5_moe.args import Qwen3_5MoeArgs

# Every layer is sparse and the router always renormalizes its top k: Qwen3_5MoeTextConfig
# has no setting for either (nor mlp_only_layers), so the native defaults hold.
CONFIG = hybrid_names(
    "qwen3_5_moe_text",
    "Qwen3_5MoeForCausalLM",
    Qwen3_5MoeArgs,
    frozenset({"norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"}),
)
ADAPTER = hybrid_adapter(CONFIG, mrope=True, grouped_projection=False)
