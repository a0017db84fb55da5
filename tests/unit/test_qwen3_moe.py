import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeDecoderLayer,
    Qwen3MoeSparseMoeBlock,
)

import temper.models as models
from temper.models.layers.moe import MoE
from temper.models.layers.moe_decoder import MoEDecoder
from temper.models.qwen3 import Qwen3Transformer
from temper.models.qwen3_moe import FLAVORS, Qwen3MoeArgs, Qwen3MoeTransformer
from temper.models.qwen3_moe.hf import args_from_hf, args_to_hf
from temper.objectives import CausalLM


def _published_count(hidden: int, layers: int, heads: int, moe_ffn: int) -> int:
    """Parameters of a published Qwen3-MoE from its config.json values (vocab 151936, untied,
    4 kv heads of 128, 128 experts, every layer sparse): attention with q/k norms, router
    [128, hidden], 128 SwiGLU experts, two block norms, final norm, embedding and head."""
    vocab, kv, hd, experts = 151936, 4, 128, 128
    attention = 2 * hidden * heads * hd + 2 * hidden * kv * hd + 2 * hd
    block = attention + experts * hidden + experts * 3 * hidden * moe_ffn + 2 * hidden
    return layers * block + hidden + 2 * vocab * hidden


PUBLISHED = {  # hidden_size, num_hidden_layers, num_attention_heads, moe_intermediate_size
    "30b_a3b": (2048, 48, 32, 768),
    "235b_a22b": (4096, 94, 64, 1536),
}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_flavor_param_counts_on_meta(flavor: str) -> None:
    model = models.build_model("qwen3_moe", flavor)
    assert sum(p.numel() for p in model.parameters()) == _published_count(*PUBLISHED[flavor])


def test_published_count_formula_matches_known_totals() -> None:
    assert _published_count(*PUBLISHED["30b_a3b"]) == 30_532_122_624
    assert _published_count(*PUBLISHED["235b_a22b"]) == 235_093_634_560


def test_flops_count_active_experts_only() -> None:
    model = models.build_model("qwen3_moe", "30b_a3b")
    experts = 48 * 128 * 3 * 2048 * 768
    embedding = 151936 * 2048
    active = 30_532_122_624 - embedding - experts + experts * 8 / 128
    assert model.flops_per_token(4096) == 6 * active + 12 * 48 * 32 * 128 * 4096
    # Published: about 3.3B activated parameters, counting the input embedding.
    assert 3.3e9 < active + embedding < 3.4e9


def test_debug_flavor_has_dense_and_moe_layers() -> None:
    args = FLAVORS["debug"]
    model = models.build_model("qwen3_moe", "debug")
    kinds = [type(layer.feed_forward).__name__ for layer in model.layers]
    assert kinds == ["FeedForward", "MoE", "MoE", "MoE"]
    assert args.vocab_size == 2048 and args.top_k == 2 and args.n_experts == 8
    assert 6e6 <= sum(p.numel() for p in model.parameters()) <= 10e6


@pytest.mark.parametrize(
    ("step", "mlp_only"), [(1, []), (2, []), (3, [1]), (1, [0, 3]), (2, [1, 4])]
)
def test_moe_layer_choice_matches_transformers(step: int, mlp_only: list[int]) -> None:
    config = Qwen3MoeConfig(
        hidden_size=8,
        intermediate_size=8,
        moe_intermediate_size=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        num_experts=2,
        num_experts_per_tok=1,
        num_hidden_layers=6,
        decoder_sparse_step=step,
        mlp_only_layers=mlp_only,
    )
    args = args_from_hf(config.to_dict())
    expected = [
        isinstance(Qwen3MoeDecoderLayer(config, i).mlp, Qwen3MoeSparseMoeBlock) for i in range(6)
    ]
    assert [args.is_moe_layer(i) for i in range(6)] == expected
    with torch.device("meta"):
        model = Qwen3MoeTransformer(args)
    assert [isinstance(layer.feed_forward, MoE) for layer in model.layers] == expected


def test_objective_adds_scaled_aux_loss_per_token() -> None:
    torch.manual_seed(0)
    model = models.build_model("qwen3_moe", "debug", device="cpu", vocab_size=64)
    ids = torch.randint(0, 64, (2, 16))
    labels = ids.clone()
    labels[0, :5] = -100
    loss_sum, n_tokens, metrics = CausalLM().loss(model, {"input_ids": ids, "labels": labels})
    ce = torch.nn.functional.cross_entropy(
        model(ids).flatten(0, 1), labels.flatten(), reduction="sum"
    )
    aux = model.aux_loss()
    assert n_tokens.item() == 27
    torch.testing.assert_close(loss_sum, ce + FLAVORS["debug"].router_aux_loss_coef * aux * 27)
    assert metrics["aux_loss"] == pytest.approx(aux.item())
    assert metrics["moe_load_imbalance"] >= 1.0


def test_aux_loss_before_any_forward_is_an_error() -> None:
    model = models.build_model("qwen3_moe", "debug")
    with pytest.raises(RuntimeError, match="run a forward"):
        model.aux_loss()


def test_bf16_autocast_forward_and_backward_on_cpu() -> None:
    torch.manual_seed(0)
    model = models.build_model("qwen3_moe", "debug", device="cpu", vocab_size=64)
    ids = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids).float().logsumexp(-1).mean() + model.aux_loss()
    loss.backward()
    grad = model.layers[1].feed_forward.experts.w2.grad
    assert grad.dtype == torch.float32 and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_moe_family_is_registered_with_its_own_adapter() -> None:
    spec = models.get_model_spec("qwen3_moe")
    # Families share the skeletons in layers/, never each other's classes.
    assert spec.model_cls is Qwen3MoeTransformer and issubclass(spec.model_cls, MoEDecoder)
    assert not issubclass(spec.model_cls, Qwen3Transformer)
    assert spec.hf_adapter.model_types == ("qwen3_moe",)
    assert models.get_model_spec("qwen3").hf_adapter.model_types == ("qwen3",)


def test_args_reject_top_k_above_experts() -> None:
    with pytest.raises(ValueError, match="top_k 3"):
        Qwen3MoeArgs(
            dim=8,
            n_layers=1,
            n_heads=2,
            n_kv_heads=1,
            head_dim=4,
            vocab_size=10,
            ffn_hidden_dim=8,
            n_experts=2,
            top_k=3,
            moe_hidden_dim=4,
            norm_topk_prob=True,
        )


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_args_survive_the_hf_config_round_trip(flavor: str) -> None:
    assert args_from_hf(args_to_hf(FLAVORS[flavor])) == FLAVORS[flavor]


def test_hub_config_reads_as_the_published_flavor() -> None:
    # Qwen3-30B-A3B's config.json as published (transformers 4.51 layout: rope_theta, num_experts).
    hub = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }
    assert args_from_hf(hub) == FLAVORS["30b_a3b"]
