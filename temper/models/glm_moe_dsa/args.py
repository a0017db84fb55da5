"""GLM-5 (`glm_moe_dsa`) sizes: DeepSeek V3.2's architecture, so its args class."""

from __future__ import annotations

from temper.models.deepseek_v32.args import FLAVORS as V32_FLAVORS
from temper.models.deepseek_v32.args import DeepseekV32Args

FLAVORS: dict[str, DeepseekV32Args] = {
    "debug": V32_FLAVORS["debug"],
    # GLM-5: transformers' GlmMoeDsaConfig defaults (its documented checkpoint zai-org/GLM-5),
    # rope at that class's default theta; 78 layers, the first 3 dense.
    "744b": DeepseekV32Args(
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
