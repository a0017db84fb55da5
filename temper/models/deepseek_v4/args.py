"""DeepSeek V4 arguments, the published sizes, and the layouts the family runs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from temper.config import Parallelism
from temper.models.fit import check_decoder_layout
from temper.models.layers.args import DecoderArgs, MoEArgs, checked_layer_types
from temper.models.layers.rope import YarnScaling

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
ATTENTION_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
MLP_TYPES = (HASH_MOE, "moe")


@dataclass(kw_only=True)
class DeepseekV4Args(MoEArgs, DecoderArgs):
    """Shapes and constants of a DeepSeek V4 model (``temper.models.deepseek_v4.model``).

    Every layer attends within ``sliding_window``; ``layer_types`` adds, per layer, nothing
    (sliding), compressed entries of ``csa_ratio`` tokens of which the indexer keeps
    ``index_topk`` (CSA), or every entry of ``hca_ratio`` tokens (HCA). ``mlp_layer_types``:
    ``hash_moe`` layers route by token id, ``moe`` ones by top-k. The residual is ``hc_mult``
    streams (hyper-connections).

    ``rope_theta`` is the sliding layers' rotary base; the compressed layers use
    ``compress_rope_theta`` with ``rope_scaling`` (transformers' ``main`` and ``compress``
    rotaries). Both turn the last ``qk_rope_head_dim`` dims of each head.
    """

    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    csa_ratio: int = 4
    hca_ratio: int = 128
    compress_rope_theta: float = 160000.0
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    n_shared_experts: int = 1
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    """Clamp of the experts' SwiGLU inputs (gate above, up both sides)."""
    router_aux_loss_coef: float = 0.0
    """Switch load-balancing loss weight; 0 as in transformers, which computes none by
    default (V4 balances with the expert bias, as V3)."""
    expert_bias_update_rate: float = 1e-3
    """Step of the aux-loss-free bias update of the top-k layers after each optimizer step."""
    mtp_depth: int = 0
    """Multi-token-prediction depths (``temper.models.deepseek_v4.mtp``), trained jointly with
    the backbone; HF's ``num_nextn_predict_layers`` (1 in the released checkpoints). 0: none,
    the model is exactly the one without MTP."""
    mtp_loss_weight: float = 0.3
    """The MTP loss weight shared by the depths (DeepSeek V3's lambda): each adds
    ``weight / mtp_depth`` times its cross-entropy."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.layer_types = checked_layer_types(self.layer_types, self.n_layers, ATTENTION_TYPES)
        mlp = tuple(self.mlp_layer_types)
        if len(mlp) != self.n_layers or set(mlp) - set(MLP_TYPES):
            raise ValueError(
                f"mlp_layer_types {list(mlp)} must hold one of {MLP_TYPES} per layer "
                f"(n_layers {self.n_layers})"
            )
        self.mlp_layer_types = mlp
        rope = self.qk_rope_head_dim
        if rope % 2 or not 0 < rope <= min(self.head_dim, self.index_head_dim):
            raise ValueError(
                f"qk_rope_head_dim {rope} must be even and at most head_dim {self.head_dim} "
                f"and index_head_dim {self.index_head_dim}"
            )
        if (self.n_heads * self.head_dim) % self.o_groups:
            raise ValueError(
                f"o_groups {self.o_groups} must divide n_heads * head_dim "
                f"({self.n_heads * self.head_dim})"
            )
        if self.mtp_depth < 0:
            raise ValueError(f"mtp_depth {self.mtp_depth} must be >= 0")
        for name in ("csa_ratio", "hca_ratio", "index_topk", "hc_mult", "hc_sinkhorn_iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be >= 1")

    @property
    def n_kv_heads(self) -> int:
        """One key-value head, shared by every query head."""
        return 1

    def is_hash_layer(self, layer_id: int) -> bool:
        return self.mlp_layer_types[layer_id] == HASH_MOE


def check_v4_layout(args: DeepseekV4Args, parallelism: Parallelism) -> None:
    """The decoder rule (experts over ``ep``, hash-routed ones dispatched like top-k ones,
    Ulysses ``sp``, with MTP too: its depths gather the next tokens over the SP group).
    Context parallelism needs nothing of the layout: each layer's attention gathers every
    rank's inputs and attends with the rank's own queries, as under SP."""
    check_decoder_layout(dataclasses.replace(args, mtp_depth=0), parallelism)


def default_layer_types(n_layers: int) -> tuple[str, ...]:
    """transformers' default schedule: two HCA layers, then CSA and HCA in turn."""
    rest = tuple(CSA if i % 2 else HCA for i in range(max(n_layers - 2, 0)))
    return (HCA,) * min(n_layers, 2) + rest


def default_mlp_layer_types(n_layers: int, n_hash: int = 3) -> tuple[str, ...]:
    """transformers' default: the first ``n_hash`` layers hash-routed, then top-k."""
    return (HASH_MOE,) * min(n_layers, n_hash) + ("moe",) * max(n_layers - n_hash, 0)


def flash_layer_types(n_layers: int) -> tuple[str, ...]:
    """Two sliding layers, then CSA and HCA in turn (``compress_ratios`` 0, 0, 4, 128, 4...)."""
    return (SLIDING,) * min(n_layers, 2) + tuple(
        HCA if i % 2 else CSA for i in range(max(n_layers - 2, 0))
    )


V4_YARN = YarnScaling(
    factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0,
    attention_factor=1.0,
)  # fmt: skip
"""The released configs' ``rope_scaling``, on the compressed layers' rotary (attention factor
1, as transformers fixes it for V4)."""


FLAVORS: dict[str, DeepseekV4Args] = {
    # Trains on a CPU with the built-in tokenizer: one layer of each attention type (and a
    # second CSA), a hash-routed layer then top-k ones; CSA keeps 8 of the entries of 4 tokens,
    # HCA pools 16, so both matter from 33 tokens on.
    "debug": DeepseekV4Args(
        dim=128,
        n_layers=4,
        n_heads=4,
        vocab_size=2048,
        head_dim=32,
        qk_rope_head_dim=16,
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=32,
        sliding_window=32,
        layer_types=(SLIDING, CSA, HCA, CSA),
        mlp_layer_types=(HASH_MOE, "moe", "moe", "moe"),
        csa_ratio=4,
        hca_ratio=16,
        index_n_heads=2,
        index_head_dim=32,
        index_topk=8,
        n_experts=8,
        top_k=2,
        moe_hidden_dim=64,
        max_seq_len=2048,
    ),
    # DeepSeek-V4-Flash (~284B): DeepseekV4Config's defaults (documented there as
    # DeepSeek-V4-Flash-Base's sizes), with the compressed layers' YaRN and the layer schedule
    # (two sliding layers, then CSA and HCA in turn) of the published config.json files of
    # Flash derivatives; load the released folder with --model.hf_path for its exact schedule.
    "flash": DeepseekV4Args(
        dim=4096,
        n_layers=43,
        n_heads=64,
        vocab_size=129280,
        head_dim=512,
        qk_rope_head_dim=64,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        sliding_window=128,
        layer_types=flash_layer_types(43),
        mlp_layer_types=default_mlp_layer_types(43),
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        n_experts=256,
        top_k=6,
        moe_hidden_dim=2048,
        rope_scaling=V4_YARN,
        max_seq_len=1048576,
    ),
    # DeepSeek-V4-Pro: the sizes of its published config.json (128 heads, 384 experts of 3072,
    # 61 layers); the layer schedule is transformers' default rule, which its config class
    # documents as V4-Pro's (two HCA layers, then CSA and HCA in turn).
    "pro": DeepseekV4Args(
        dim=7168,
        n_layers=61,
        n_heads=128,
        vocab_size=129280,
        head_dim=512,
        qk_rope_head_dim=64,
        q_lora_rank=1536,
        o_groups=16,
        o_lora_rank=1024,
        sliding_window=128,
        layer_types=default_layer_types(61),
        mlp_layer_types=default_mlp_layer_types(61),
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        n_experts=384,
        top_k=6,
        moe_hidden_dim=3072,
        routed_scaling_factor=2.5,
        rope_scaling=V4_YARN,
        max_seq_len=1048576,
    ),
}
