"""DeepSeek V3 architecture arguments and the published sizes."""

from dataclasses import dataclass

from temper.models.layers.args import DecoderArgs, MoEArgs
from temper.models.layers.rope import YarnScaling, yarn_mscale


@dataclass(kw_only=True)
class DeepseekV3Args(MoEArgs, DecoderArgs):
    """Shapes and constants of a DeepSeek V3 model (MLA attention, sigmoid-routed experts).

    The first ``n_dense_layers`` blocks have a dense SwiGLU of ``ffn_hidden_dim``; the rest an
    MoE of ``n_experts`` routed experts (``moe_hidden_dim`` each, ``top_k`` per token among the
    ``topk_group`` best of ``n_groups`` groups) plus ``n_shared_experts`` that see every token.
    """

    ffn_hidden_dim: int
    q_lora_rank: int | None
    """None: queries come straight from ``wq`` (Moonlight, DeepSeek-V2-Lite)."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_dense_layers: int
    """HF's ``first_k_dense_replace``."""
    n_shared_experts: int
    n_groups: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool = True
    rope_interleave: bool = True
    """Checkpoint q/k rope dims in interleaved pairs (DeepSeek's own layout, HF's default)."""
    router_aux_loss_coef: float = 0.0
    """Weight of the Switch load-balancing loss (on normalized sigmoid affinities). 0: DeepSeek
    V3 balances with the expert bias instead, and transformers' class computes no aux loss."""
    expert_bias_update_rate: float = 1e-3
    """Step of the aux-loss-free bias update after each optimizer step; 0 disables it."""
    mtp_depth: int = 0
    """Multi-token-prediction depths after the last layer (HF's num_nextn_predict_layers; 1 in
    DeepSeek-V3's checkpoint). 0: none, the model is exactly the one without MTP."""
    mtp_loss_weight: float = 0.3
    """The MTP loss weight (DeepSeek V3's lambda, 0.3 early in its pretraining, then 0.1),
    shared by the depths: each adds ``weight / mtp_depth`` times its cross-entropy."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mtp_depth < 0:
            raise ValueError(f"mtp_depth {self.mtp_depth} must be >= 0")
        if self.n_experts % self.n_groups or self.n_experts // self.n_groups < 2:
            # Group scores sum each group's two best experts.
            raise ValueError(
                f"n_experts {self.n_experts} must split into n_groups {self.n_groups} groups "
                "of at least 2 experts"
            )
        if not 0 < self.topk_group <= self.n_groups:
            raise ValueError(f"topk_group {self.topk_group} must be in [1, {self.n_groups}]")
        if self.top_k > self.topk_group * self.n_experts // self.n_groups:
            raise ValueError(
                f"top_k {self.top_k} exceeds the {self.topk_group} kept groups' experts"
            )

    @property
    def n_kv_heads(self) -> int:
        """MLA expands one key and value per query head."""
        return self.n_heads

    @property
    def head_dim(self) -> int:
        """Rotary dims per head (HF's DeepseekV3Config calls them head_dim too)."""
        return self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5``; with YaRN's ``mscale_all_dim`` also times its mscale
        squared, since the longer context flattens the attention logits (transformers' rule)."""
        scale = self.qk_head_dim**-0.5
        s = self.rope_scaling
        if s is not None and s.mscale_all_dim:
            mscale = yarn_mscale(s.factor, s.mscale_all_dim)
            scale = scale * mscale * mscale
        return scale

    @property
    def rope_scale(self) -> float:
        """YaRN's attention factor on cos and sin (1 without scaling)."""
        return 1.0 if self.rope_scaling is None else self.rope_scaling.rope_scale()

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.n_dense_layers


FLAVORS: dict[str, DeepseekV3Args] = {
    # Holds the built-in tokenizer and trains on a CPU: q and kv latents, 8 experts in 2 groups
    # (one kept per token), top 2 plus a shared expert; layer 0 dense.
    "debug": DeepseekV3Args(
        dim=256,
        n_layers=4,
        n_heads=8,
        vocab_size=2048,
        ffn_hidden_dim=768,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_dense_layers=1,
        n_experts=8,
        n_shared_experts=1,
        top_k=2,
        moe_hidden_dim=256,
        n_groups=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        max_seq_len=2048,
    ),
    # Moonlight-16B-A3B's config.json (a published deepseek_v3 checkpoint). torchtitan's "16B"
    # is DeepSeek-V2-Lite, whose softmax router transformers' deepseek_v3 class cannot express.
    "16b": DeepseekV3Args(
        dim=2048,
        n_layers=27,
        n_heads=16,
        vocab_size=163840,
        ffn_hidden_dim=11264,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_dense_layers=1,
        n_experts=64,
        n_shared_experts=2,
        top_k=6,
        moe_hidden_dim=1408,
        n_groups=1,
        topk_group=1,
        routed_scaling_factor=2.446,
        norm_eps=1e-5,
        rope_theta=50000.0,
        max_seq_len=8192,
    ),
    # DeepSeek-V3's config.json, without its multi-token-prediction layer (mtp_depth=1 adds it).
    "671b": DeepseekV3Args(
        dim=7168,
        n_layers=61,
        n_heads=128,
        vocab_size=129280,
        ffn_hidden_dim=18432,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_dense_layers=3,
        n_experts=256,
        n_shared_experts=1,
        top_k=8,
        moe_hidden_dim=2048,
        n_groups=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        rope_scaling=YarnScaling(
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        max_seq_len=163840,
    ),
}
