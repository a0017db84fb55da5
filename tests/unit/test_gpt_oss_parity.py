"""gpt-oss against transformers' own `GptOssForCausalLM`, through HF folders on disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_parity import check_forward_and_grads, check_round_trip, randomize_norms
from transformers import AutoModelForCausalLM, GptOssConfig, PreTrainedModel

from temper.models import load_hf
from temper.models.gpt_oss import GptOssTransformer
from temper.models.hf import read_hf_args

_BASE = {
    "vocab_size": 96,
    "hidden_size": 48,
    "intermediate_size": 40,
    "head_dim": 12,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 6,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
}
CASES = {
    # The release's settings at a tiny size: YaRN (untruncated ramp), alternating sliding and
    # full layers, sliding first; a clamp limit that the random experts reach.
    "yarn_alternating": GptOssConfig(
        **_BASE,
        num_hidden_layers=3,
        swiglu_limit=1.5,
        max_position_embeddings=128,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
    ),
    # Plain rope, a hand-written layer order (full first, two sliding in a row), tied
    # embeddings, another alpha, and the load-balancing loss in transformers' loss.
    "default_rope_aux_loss": GptOssConfig(
        **_BASE,
        num_hidden_layers=3,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        swiglu_alpha=1.2,
        swiglu_limit=2.0,
        tie_word_embeddings=True,
        output_router_logits=True,
        router_aux_loss_coef=0.05,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}


def tiny_hf(config: GptOssConfig, folder: Path) -> PreTrainedModel:
    """A seeded random HF model whose sinks, biases and norms are far from their inits (HF
    zeroes the expert biases and draws sinks near 0, which would hide a dropped one), saved."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    randomize_norms(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.uniform_(-1.0, 2.0)
            elif name.endswith(("_bias", "proj.bias", "router.bias")):
                param.uniform_(-0.3, 0.3)
            elif name.endswith("router.weight"):  # clear top-k margins: no near-tie flips
                param.normal_(0.0, 0.5)
            elif name.endswith(("gate_up_proj", "down_proj")):
                param.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return model.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers_past_the_window(case: str, tmp_path: Path) -> None:
    """40 tokens, 5 windows of 8: the sliding layers drop most keys."""
    hf = tiny_hf(CASES[case], tmp_path)
    native = load_hf(tmp_path)
    assert type(native) is GptOssTransformer
    windows = [layer.attention.window for layer in native.layers]
    expected = [8 if t == "sliding_attention" else None for t in hf.config.layer_types]
    assert windows == expected
    errors = check_forward_and_grads(hf, native, seq_len=40, grad_rtol=1e-5)
    assert errors["logits"] <= 1e-5


def test_sinks_windows_and_clamp_matter(tmp_path: Path) -> None:
    """Each feature the parity covers changes the logits on its inputs, so parity tests it."""
    tiny_hf(CASES["yarn_alternating"], tmp_path)
    native = load_hf(tmp_path)
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = native(ids)
        changed = {}
        for layer in native.layers:
            layer.attention.sinks.add_(5.0)
        changed["sinks"] = native(ids)
        for layer in native.layers:
            layer.attention.sinks.sub_(5.0)
            layer.attention.window = None
        changed["window"] = native(ids)
        native = load_hf(tmp_path)
        for layer in native.layers:
            layer.feed_forward.experts.act = type(layer.feed_forward.experts.act)(1.702, 1e9)
        changed["clamp"] = native(ids)
    for what, logits in changed.items():
        assert (logits - base).abs().max() > 1e-3, what


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_is_bit_identical(case: str, tmp_path: Path) -> None:
    hf = tiny_hf(CASES[case], tmp_path / "hf")
    check_round_trip(tmp_path / "hf", tmp_path / "out", hf)
    assert read_hf_args(tmp_path / "out") == read_hf_args(tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").config
    for field in ("layer_types", "sliding_window", "swiglu_alpha", "swiglu_limit"):
        assert getattr(reloaded, field) == getattr(hf.config, field), field
