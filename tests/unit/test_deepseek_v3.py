"""DeepSeek V3: flavors, config mapping, router, expert-bias balancing, objective."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3TopkRouter,
    yarn_apply_mscale,
)

import temper.models as models
from temper.models.deepseek_v3 import FLAVORS, DeepseekV3Args, DeepseekV3Transformer
from temper.models.deepseek_v3.hf import args_from_hf, args_to_hf
from temper.models.layers.moe import moe_layers
from temper.models.layers.rope import rope_inv_freq
from temper.models.layers.routers import GroupLimitedRouter, GroupLimitedRouting, update_expert_bias
from temper.models.protocols import PostStepHook
from temper.objectives import CausalLM


def _published_count(
    vocab: int,
    dim: int,
    layers: int,
    dense_layers: int,
    heads: int,
    q_lora: int | None,
    ffn: int,
    experts: int,
    shared: int,
    moe_ffn: int,
) -> int:
    """Parameters of a published config.json (kv_lora 512, qk 128 + 64 rope, v 128, untied):
    MLA projections and latent norms, two block norms, dense SwiGLU or router + routed and
    shared SwiGLUs, final norm, embedding and head. Expert biases are buffers, not counted."""
    kv_lora, nope, rope, v = 512, 128, 64, 128
    q = (
        dim * heads * (nope + rope)
        if q_lora is None
        else q_lora * (dim + 1 + heads * (nope + rope))
    )
    attention = (
        q + dim * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v) + heads * v * dim
    )
    moe = experts * dim + (experts + shared) * 3 * dim * moe_ffn
    block = attention + 2 * dim
    return (
        layers * block
        + dense_layers * 3 * dim * ffn
        + (layers - dense_layers) * moe
        + dim
        + 2 * vocab * dim
    )


PUBLISHED = {  # vocab, hidden, layers, first_k_dense, heads, q_lora, ffn, experts, shared, moe_ffn
    "16b": (163840, 2048, 27, 1, 16, None, 11264, 64, 2, 1408),  # Moonlight-16B-A3B
    "671b": (129280, 7168, 61, 3, 128, 1536, 18432, 256, 1, 2048),  # DeepSeek-V3
}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_flavor_param_counts_on_meta(flavor: str) -> None:
    model = models.build_model("deepseek_v3", flavor)
    assert sum(p.numel() for p in model.parameters()) == _published_count(*PUBLISHED[flavor])


def test_published_count_formula_matches_known_totals() -> None:
    # DeepSeek-V3: 671B without its multi-token-prediction module.
    assert _published_count(*PUBLISHED["671b"]) == 671_026_404_352
    # Moonlight: 15.29B parameters besides the two 163840 x 2048 embedding tables.
    moonlight = _published_count(*PUBLISHED["16b"])
    assert moonlight == 15_960_108_544
    assert round((moonlight - 2 * 163840 * 2048) / 1e9, 2) == 15.29


def test_flops_count_active_experts_and_mla_head_dims() -> None:
    model = models.build_model("deepseek_v3", "671b")
    routed = 58 * 256 * 3 * 7168 * 2048
    embedding = 129280 * 7168
    active = 671_026_404_352 - embedding - routed + routed * 8 / 256
    attention = 6 * 61 * 128 * (192 + 128) * 4096
    assert model.flops_per_token(4096) == 6 * active + attention
    # Published: 37B activated parameters per token, counting the input embedding.
    assert 37e9 < active + embedding < 38e9


def test_debug_flavor_has_dense_and_moe_layers() -> None:
    args = FLAVORS["debug"]
    model = models.build_model("deepseek_v3", "debug")
    kinds = [type(layer.feed_forward).__name__ for layer in model.layers]
    assert kinds == ["FeedForward", "MoE", "MoE", "MoE"]
    assert isinstance(model.layers[1].feed_forward.router, GroupLimitedRouter)
    assert args.vocab_size == 2048 and (args.n_experts, args.top_k, args.n_groups) == (8, 2, 2)
    assert 6e6 <= sum(p.numel() for p in model.parameters()) <= 10e6


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"n_groups": 3}, "split into n_groups 3"),
        ({"n_groups": 8}, "groups of at least 2"),
        ({"topk_group": 3}, "topk_group 3"),
        ({"top_k": 5}, "top_k 5 exceeds"),
    ],
)
def test_args_reject_invalid_routing(change: dict, message: str) -> None:
    fields = {**vars(FLAVORS["debug"]), **change}
    with pytest.raises(ValueError, match=message):
        DeepseekV3Args(**fields)


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_args_survive_the_hf_config_round_trip(flavor: str) -> None:
    assert args_from_hf(args_to_hf(FLAVORS[flavor])) == FLAVORS[flavor]


_HUB_671B = {  # DeepSeek-V3's config.json as published (transformers 4.x layout)
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "v_head_dim": 128,
    "vocab_size": 129280,
}
_HUB_MOONLIGHT = {  # Moonlight-16B-A3B's config.json, the fields that set the architecture
    **{k: _HUB_671B[k] for k in ("hidden_act", "kv_lora_rank", "qk_nope_head_dim")},
    **{k: _HUB_671B[k] for k in ("qk_rope_head_dim", "v_head_dim", "model_type")},
    "first_k_dense_replace": 1,
    "hidden_size": 2048,
    "intermediate_size": 11264,
    "max_position_embeddings": 8192,
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "rms_norm_eps": 1e-05,
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.446,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "vocab_size": 163840,
}


def test_hub_configs_read_as_the_published_flavors() -> None:
    # The hub config declares its MTP layer (num_nextn_predict_layers 1); the flavor has none.
    assert args_from_hf(_HUB_671B) == dataclasses.replace(FLAVORS["671b"], mtp_depth=1)
    assert args_from_hf(_HUB_MOONLIGHT) == FLAVORS["16b"]


def test_671b_rope_and_softmax_scale_equal_transformers() -> None:
    config = DeepseekV3Config(**{k: v for k, v in _HUB_671B.items() if k != "architectures"})
    args = FLAVORS["671b"]
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, None)
    assert torch.equal(rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling), inv_freq)
    assert args.rope_scale == attention_factor == 1.0
    # DeepseekV3Attention.scaling, 192 ** -0.5 * (0.1 * ln 40 + 1) ** 2, without 61 layers
    assert args.softmax_scale == yarn_apply_mscale(config.rope_parameters, 192**-0.5)
    assert args.softmax_scale == pytest.approx(192**-0.5 * 1.3688879454**2)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
        ({"topk_method": "greedy"}, "topk_method 'greedy'"),
        ({"moe_layer_freq": 2}, "moe_layer_freq 2"),
        ({"num_key_value_heads": 16}, "num_key_value_heads 16"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "'linear' is not supported"),
    ],
)
def test_hf_settings_the_model_lacks_are_refused(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        args_from_hf({**_HUB_671B, **change})


@pytest.mark.parametrize(
    ("experts", "groups", "topk_group", "top_k"), [(8, 2, 1, 2), (16, 4, 2, 3)]
)
def test_router_matches_transformers(
    experts: int, groups: int, topk_group: int, top_k: int
) -> None:
    config = DeepseekV3Config(
        hidden_size=16,
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        n_group=groups,
        topk_group=topk_group,
        routed_scaling_factor=2.5,
    )
    torch.manual_seed(0)
    theirs = DeepseekV3TopkRouter(config)
    ours = GroupLimitedRouter(
        16, experts, top_k, True, GroupLimitedRouting(groups, topk_group, 2.5)
    )
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.e_score_correction_bias.uniform_(-0.3, 0.3)
        ours.gate.weight.copy_(theirs.weight)
        ours.expert_bias.copy_(theirs.e_score_correction_bias)
    x = torch.randn(64, 16)
    probs, weights, chosen = ours(x)
    logits, expected_weights, expected = theirs(x)
    order, expected_order = chosen.argsort(-1), expected.argsort(-1)
    assert torch.equal(chosen.gather(1, order), expected.gather(1, expected_order))
    torch.testing.assert_close(
        weights.gather(1, order), expected_weights.gather(1, expected_order), rtol=0, atol=0
    )
    scores = logits.sigmoid()
    torch.testing.assert_close(probs, scores / scores.sum(-1, keepdim=True))
    # Every token's experts lie in at most topk_group groups, and the bias changed choices.
    groups_used = [len(set(row.tolist())) for row in chosen // (experts // groups)]
    assert max(groups_used) <= topk_group
    with torch.no_grad():
        ours.expert_bias.zero_()
    assert not torch.equal(ours(x)[2].sort(-1).values, chosen.sort(-1).values)


def _routers(loads: list[list[int]]) -> list[GroupLimitedRouter]:
    routers = []
    for load in loads:
        router = GroupLimitedRouter(4, 4, 2, True, GroupLimitedRouting(2, 1, 1.0))
        router.init_weights(0.02)
        router.load.copy_(torch.tensor(load))
        routers.append(router)
    return routers


def test_expert_bias_update_by_hand() -> None:
    routers = _routers([[4, 0, 2, 2], [1, 1, 1, 5]])  # means 2 and 2
    update_expert_bias(routers, 0.01)
    assert routers[0].expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])
    assert routers[1].expert_bias.tolist() == pytest.approx([0.01, 0.01, 0.01, -0.01])
    assert all(r.load.sum() == 0 for r in routers)
    # A second step from new counts adds to the bias; rate 0 only restarts the counts.
    routers[0].load.copy_(torch.tensor([0, 3, 3, 2]))  # mean 2: signs [1, -1, -1, 0]
    update_expert_bias(routers, 0.01)
    assert routers[0].expert_bias.tolist() == pytest.approx([0.0, 0.0, -0.01, 0.0])
    routers[0].load.copy_(torch.tensor([9, 0, 0, 0]))
    update_expert_bias(routers, 0.0)
    assert routers[0].expert_bias.tolist() == pytest.approx([0.0, 0.0, -0.01, 0.0])
    assert routers[0].load.sum() == 0


def test_expert_bias_update_sums_counts_over_the_world(monkeypatch: pytest.MonkeyPatch) -> None:
    """With torch.distributed up, one all-reduce over the world sums every router's counts
    first: here another rank's counts turn expert 1 from under- to overloaded."""
    calls = []

    def all_reduce(tensor: torch.Tensor, group: object = None) -> None:
        calls.append(group)
        tensor += torch.tensor([[0, 6, 0, 2], [2, 2, 2, 2]])  # the other rank's counts

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    routers = _routers([[4, 0, 2, 2], [1, 1, 1, 5]])
    update_expert_bias(routers, 0.5)
    assert calls == [None]
    # Sums [4, 6, 2, 4] (mean 4) and [3, 3, 3, 7] (mean 4).
    assert routers[0].expert_bias.tolist() == [0.0, -0.5, 0.5, 0.0]
    assert routers[1].expert_bias.tolist() == [0.5, 0.5, 0.5, -0.5]


def test_training_forwards_count_the_load_the_model_update_reads() -> None:
    torch.manual_seed(0)
    model = models.build_model("deepseek_v3", "debug", device="cpu", vocab_size=64)
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        model(ids)  # no autograd: not a training step, not counted
    model.eval()
    model(ids)
    moes = list(moe_layers(model).values())
    assert all(m.router.load.sum() == 0 for m in moes)
    model.train()
    model(ids)
    model(ids)  # gradient accumulation: two micro-batches before one optimizer step
    for moe, stats in zip(moes, model.routing(), strict=True):
        assert torch.equal(moe.router.load, 2 * stats.tokens_per_expert)
    loads = [moe.router.load.float() for moe in moes]
    assert isinstance(model, PostStepHook)
    model.after_optimizer_step()  # moves by args.expert_bias_update_rate
    for moe, load in zip(moes, loads, strict=True):
        torch.testing.assert_close(moe.router.expert_bias, 1e-3 * torch.sign(load.mean() - load))
        assert moe.router.load.sum() == 0


def test_objective_loss_has_no_aux_term_by_default_but_logs_it() -> None:
    torch.manual_seed(0)
    model = models.build_model("deepseek_v3", "debug", device="cpu", vocab_size=64)
    ids = torch.randint(0, 64, (2, 16))
    labels = ids.clone()
    labels[0, :5] = -100
    batch = {"input_ids": ids, "labels": labels}
    loss_sum, n_tokens, metrics = CausalLM().loss(model, batch)
    ce = torch.nn.functional.cross_entropy(
        model(ids).flatten(0, 1), labels.flatten(), reduction="sum"
    )
    torch.testing.assert_close(loss_sum, ce)
    assert metrics["aux_loss"] == pytest.approx(model.aux_loss().item())
    assert metrics["moe_load_imbalance"] >= 1.0
    model.args.router_aux_loss_coef = 0.01
    loss_sum, _, _ = CausalLM().loss(model, batch)
    torch.testing.assert_close(loss_sum, ce + 0.01 * model.aux_loss() * n_tokens)


def test_bf16_autocast_forward_and_backward_on_cpu() -> None:
    torch.manual_seed(0)
    model = models.build_model("deepseek_v3", "debug", device="cpu", vocab_size=64)
    ids = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids).float().logsumexp(-1).mean()
    loss.backward()
    for grad in (
        model.layers[1].feed_forward.experts.w2.grad,
        model.layers[2].attention.wkv_b.weight.grad,
    ):
        assert grad.dtype == torch.float32 and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_family_is_registered_with_its_adapter() -> None:
    spec = models.get_model_spec("deepseek_v3")
    assert spec.model_cls is DeepseekV3Transformer
    assert spec.hf_adapter.model_types == ("deepseek_v3",)
