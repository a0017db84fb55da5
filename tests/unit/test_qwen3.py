import pytest
import torch

import temper.models as models
from temper.models.qwen3 import FLAVORS, Qwen3Transformer
from temper.models.qwen3.hf import args_from_hf, args_to_hf


def _published_count(hidden: int, layers: int, heads: int, ffn: int, tied: bool) -> int:
    """Parameters of a published Qwen3 from its config.json values (vocab 151936, 8 kv heads,
    head_dim 128): q/o [heads*128, hidden], k/v [8*128, hidden], q/k norms [128], SwiGLU,
    two block norms, final norm, embedding (and head when untied)."""
    vocab, kv, hd = 151936, 8, 128
    attention = 2 * hidden * heads * hd + 2 * hidden * kv * hd + 2 * hd
    block = attention + 3 * hidden * ffn + 2 * hidden
    return layers * block + hidden + vocab * hidden * (1 if tied else 2)


PUBLISHED = {  # hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, tied
    "0.6b": (1024, 28, 16, 3072, True),
    "1.7b": (2048, 28, 16, 6144, True),
    "4b": (2560, 36, 32, 9728, True),
    "8b": (4096, 36, 32, 12288, False),
    "14b": (5120, 40, 40, 17408, False),
    "32b": (5120, 64, 64, 25600, False),
}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_flavor_param_counts_on_meta(flavor: str) -> None:
    model = models.build_model("qwen3", flavor)
    assert model.output.weight.is_meta
    n = sum(p.numel() for p in model.parameters())
    assert n == _published_count(*PUBLISHED[flavor])


def test_published_count_formula_matches_known_totals() -> None:
    assert _published_count(*PUBLISHED["0.6b"]) == 596_049_920
    assert _published_count(*PUBLISHED["8b"]) == 8_190_735_360


def test_debug_flavor_fits_tokenizer_and_size() -> None:
    args = FLAVORS["debug"]
    with torch.device("meta"):
        model = Qwen3Transformer(args)
    assert args.vocab_size == 2048 and args.tie_embeddings
    assert args.head_dim != args.dim // args.n_heads
    assert 4e6 <= sum(p.numel() for p in model.parameters()) <= 6e6


def test_flops_per_token_by_hand() -> None:
    untied, tied = models.build_model("qwen3", "8b"), models.build_model("qwen3", "0.6b")
    # 8B: the input embedding (a lookup) is excluded; 36 layers of 32 heads of 128.
    assert untied.flops_per_token(4096) == 6 * (8_190_735_360 - 151936 * 4096) + 12 * 36 * 32 * (
        128 * 4096
    )
    # 0.6B ties the head to the embedding: the one table counts once, as the head.
    assert tied.flops_per_token(2048) == 6 * 596_049_920 + 12 * 28 * 16 * 128 * 2048


def test_init_materializes_qk_norms_and_keeps_the_tie() -> None:
    torch.manual_seed(0)
    model = models.build_model("qwen3", "debug", device="cpu")
    attention = model.layers[0].attention
    assert attention.q_norm.weight.shape == (64,)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
    assert model.output.weight is model.tok_embeddings.weight
    logits = model(torch.randint(0, 2048, (1, 12)))
    assert logits.shape == (1, 12, 2048) and torch.isfinite(logits).all()


def _hf_config(**overrides: object) -> dict:
    config = {
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "intermediate_size": 96,
    }
    return {**config, **overrides}


def test_args_from_hf_defaults_head_dim_as_qwen3config_does() -> None:
    # Qwen3Config's head_dim default is 128, not hidden_size / heads (16 here).
    assert args_from_hf(_hf_config()).head_dim == 128
    assert args_from_hf(_hf_config(head_dim=32)).head_dim == 32


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"use_sliding_window": True}, "sliding-window"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "rope type 'yarn'"),
    ],
)
def test_args_from_hf_refuses_what_the_model_lacks(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        args_from_hf(_hf_config(**overrides))


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_args_survive_the_hf_config_round_trip(flavor: str) -> None:
    assert args_from_hf(args_to_hf(FLAVORS[flavor])) == FLAVORS[flavor]


def test_hub_config_reads_as_the_published_flavor() -> None:
    # Qwen3-8B's config.json as published (transformers 4.51 layout: rope_theta, rope_scaling).
    hub = {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "max_position_embeddings": 40960,
        "max_window_layers": 36,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }
    assert args_from_hf(hub) == FLAVORS["8b"]
