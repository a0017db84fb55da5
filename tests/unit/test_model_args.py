"""The args bases in temper/models/layers/args.py: a family keeps the defaults it declares
when an MoE mixin is added, and the shared checks and MoE layer rules hold for every family."""

from __future__ import annotations

import dataclasses

import pytest

from temper.models.deepseek_v3 import FLAVORS as DEEPSEEK
from temper.models.gpt_oss import FLAVORS as GPT_OSS
from temper.models.layers.args import DecoderArgs, GQAArgs, MoEArgs
from temper.models.layers.hybrid import HybridMoeArgs, interval_layer_types
from temper.models.qwen3 import Qwen3Args
from temper.models.qwen3_moe import FLAVORS as QWEN3_MOE
from temper.models.qwen3_moe import Qwen3MoeArgs
from temper.models.qwen3_next import Qwen3NextArgs

SIZES = {"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 32}
EXPERTS = {"n_experts": 4, "top_k": 2, "moe_hidden_dim": 16}


def _defaults(cls: type) -> dict[str, object]:
    return {
        f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING
    }


def test_an_moe_mixin_keeps_the_family_defaults() -> None:
    # Qwen3's own rope theta and context (1e6, 40960), not DecoderArgs' (1e4, 4096).
    qwen3, moe = _defaults(Qwen3Args), _defaults(Qwen3MoeArgs)
    assert qwen3["rope_theta"] == moe["rope_theta"] == 1000000.0
    assert qwen3["max_seq_len"] == moe["max_seq_len"] == 40960
    assert _defaults(Qwen3NextArgs)["rope_theta"] == 10000000.0
    assert _defaults(type(DEEPSEEK["debug"]))["router_aux_loss_coef"] == 0.0
    assert _defaults(type(GPT_OSS["debug"]))["attention_bias"] is True


def test_every_family_is_built_on_the_bases() -> None:
    assert issubclass(Qwen3MoeArgs, GQAArgs) and issubclass(Qwen3MoeArgs, MoEArgs)
    assert issubclass(type(DEEPSEEK["debug"]), DecoderArgs)
    assert not issubclass(type(DEEPSEEK["debug"]), GQAArgs)
    assert DEEPSEEK["debug"].n_kv_heads == DEEPSEEK["debug"].n_heads


def test_shared_checks() -> None:
    base = {**SIZES, "ffn_hidden_dim": 32}
    assert Qwen3MoeArgs(**base, **EXPERTS).head_dim == 16  # 0: dim // n_heads
    with pytest.raises(ValueError, match="n_kv_heads 3"):
        Qwen3MoeArgs(**(base | {"n_kv_heads": 3}), **EXPERTS)
    with pytest.raises(ValueError, match="top_k 5"):
        Qwen3MoeArgs(**base, **(EXPERTS | {"top_k": 5}))
    with pytest.raises(ValueError, match="decoder_sparse_step 0"):
        Qwen3MoeArgs(**base, **EXPERTS, decoder_sparse_step=0)
    with pytest.raises(TypeError):
        Qwen3Args(64, 4, 4, 32, n_kv_heads=2, ffn_hidden_dim=32)  # keyword-only


def test_moe_layers_follow_each_familys_rule() -> None:
    # transformers' Qwen rule: not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
    hybrid = HybridMoeArgs(
        **SIZES,
        **EXPERTS,
        head_dim=16,
        ffn_hidden_dim=32,
        layer_types=interval_layer_types(4),
        linear_n_k_heads=2,
        linear_n_v_heads=4,
        linear_k_head_dim=8,
        linear_v_head_dim=8,
        shared_expert_hidden_dim=16,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    )
    assert [hybrid.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert hybrid.mlp_only_layers == (3,)
    assert [QWEN3_MOE["debug"].is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert [DEEPSEEK["debug"].is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert all(GPT_OSS["debug"].is_moe_layer(i) for i in range(4))
