"""Multi-head latent attention against transformers' DeepseekV3Attention and by hand."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
    apply_rotary_pos_emb_interleave,
)

from temper.kernels.attention import DocumentMask
from temper.models.deepseek_v3.hf import args_from_hf
from temper.models.layers.context import ForwardContext
from temper.models.layers.mla import MLA
from temper.models.layers.rope import apply_rope, rope_cos_sin, rope_inv_freq

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}


def _config(q_lora_rank: int | None, interleave: bool, rope: dict) -> DeepseekV3Config:
    config = DeepseekV3Config(
        hidden_size=48,
        num_attention_heads=3,
        num_key_value_heads=3,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=6,
        v_head_dim=5,
        rope_interleave=interleave,
        max_position_embeddings=64,
        rope_parameters=rope,
        n_routed_experts=4,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
    )
    config._attn_implementation = "eager"  # explicit softmax(q k^T * scaling) v
    return config


def _native(config: DeepseekV3Config) -> MLA:
    args = args_from_hf(config.to_dict())
    return MLA(
        args.dim,
        args.n_heads,
        args.q_lora_rank,
        args.kv_lora_rank,
        args.qk_nope_head_dim,
        args.qk_rope_head_dim,
        args.v_head_dim,
        softmax_scale=args.softmax_scale,
        rope_scale=args.rope_scale,
        rope_interleaved=args.rope_interleave,
    )


@pytest.mark.parametrize(
    ("q_lora_rank", "interleave", "rope"),
    [
        (10, True, YARN),
        (None, False, YARN),
        (None, True, {"rope_type": "default", "rope_theta": 1e4}),
    ],
)
def test_mla_matches_transformers_eager_attention(
    q_lora_rank: int | None, interleave: bool, rope: dict
) -> None:
    config = _config(q_lora_rank, interleave, rope)
    torch.manual_seed(0)
    theirs = DeepseekV3Attention(config, layer_idx=0)
    ours = _native(config)
    with torch.no_grad():
        for param in theirs.parameters():
            param.normal_(0.0, 0.3)
    names = {  # ours -> theirs
        "wq": "q_proj",
        "wq_a": "q_a_proj",
        "q_norm": "q_a_layernorm",
        "wq_b": "q_b_proj",
        "wkv_a": "kv_a_proj_with_mqa",
        "kv_norm": "kv_a_layernorm",
        "wkv_b": "kv_b_proj",
        "wo": "o_proj",
    }
    state = theirs.state_dict()
    module_param = (key.split(".") for key in ours.state_dict())
    ours.load_state_dict({f"{m}.{p}": state[f"{names[m]}.{p}"] for m, p in module_param})
    assert ours.softmax_scale == theirs.scaling
    x = torch.randn(2, 20, 48)
    positions = torch.arange(20)[None].expand(2, 20)
    rotary = DeepseekV3RotaryEmbedding(config)
    mask = torch.full((20, 20), float("-inf")).triu(1)[None, None]
    expected, _ = theirs(x, rotary(x, positions), attention_mask=mask)
    args = args_from_hf(config.to_dict())
    cos, sin = rope_cos_sin(rope_inv_freq(6, args.rope_theta, args.rope_scaling), positions)
    torch.testing.assert_close(ours(x, ForwardContext(cos, sin)), expected, rtol=1e-5, atol=1e-6)


def test_interleaved_rope_is_bitwise_transformers() -> None:
    q, k = torch.randn(2, 7, 3, 8), torch.randn(2, 7, 1, 8)
    cos, sin = rope_cos_sin(rope_inv_freq(8, 10000.0), torch.arange(7)[None].expand(2, 7))
    q_ref, k_ref = apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=2)
    assert torch.equal(apply_rope(q, cos, sin, interleaved=True), q_ref)
    assert torch.equal(apply_rope(k, cos, sin, interleaved=True), k_ref)


def test_interleaved_rope_rotates_adjacent_pairs_by_hand() -> None:
    # Pair (0, 1) turns by angle pos * 1, pair (2, 3) by pos * theta ** -0.5; output is
    # rotate-half ordered: first members (0, 2), then second members (1, 3).
    theta, pos, x = 100.0, 3, [0.5, -1.0, 2.0, 0.25]
    cos, sin = rope_cos_sin(rope_inv_freq(4, theta), torch.tensor([[pos]]))
    got = apply_rope(torch.tensor(x).view(1, 1, 1, 4), cos, sin, interleaved=True).flatten()
    angles = torch.tensor([pos * 1.0, pos * theta**-0.5], dtype=torch.float64)
    a, b = torch.tensor(x[0::2], dtype=torch.float64), torch.tensor(x[1::2], dtype=torch.float64)
    expected = torch.cat([a * angles.cos() - b * angles.sin(), b * angles.cos() + a * angles.sin()])
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-6)


def test_packed_documents_attend_only_within_themselves() -> None:
    torch.manual_seed(0)
    mla = _native(_config(10, True, YARN))
    for param in mla.parameters():
        torch.nn.init.normal_(param, std=0.3)
    x = torch.randn(1, 12, 48)
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    inv_freq = rope_inv_freq(6, 10000.0)
    cos, sin = rope_cos_sin(inv_freq, positions)
    packed = mla(x, ForwardContext(cos, sin, DocumentMask.from_position_ids(positions)))
    for start, end in ((0, 5), (5, 12)):
        alone = mla(x[:, start:end], ForwardContext(cos[:, start:end], sin[:, start:end]))
        torch.testing.assert_close(packed[:, start:end], alone, rtol=1e-5, atol=1e-6)
