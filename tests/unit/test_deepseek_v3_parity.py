"""DeepSeek V3 against transformers' own class, through HF folders on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_parity import check_forward_and_grads, check_round_trip, randomize_norms
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, PreTrainedModel

from temper.models import load_hf, save_hf
from temper.models.deepseek_v3 import DeepseekV3Transformer
from temper.models.hf import read_hf_args
from temper.models.layers.moe import moe_layers
from temper.models.layers.routers import update_expert_bias

_BASE = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 80,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 12,
    "qk_rope_head_dim": 8,
    "v_head_dim": 10,  # unlike qk_head_dim 20
    "n_routed_experts": 8,
}
CASES = {
    # Latent queries, YaRN with mscale != mscale_all_dim (both the cos/sin factor and the
    # softmax correction differ from 1), interleaved rope, 2 groups of 4 with 1 kept, top 2,
    # a shared expert; rms_norm_eps 1e-5 while HF's latent norms keep 1e-6.
    "q_lora_yarn_interleaved": DeepseekV3Config(
        **_BASE,
        q_lora_rank=20,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        rms_norm_eps=1e-5,
        rope_interleave=True,
        max_position_embeddings=64,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "mscale": 0.9,
            "mscale_all_dim": 0.7,
        },
    ),
    # Plain q projection, no rope scaling, rotate-half rope, 4 groups of 2 with 2 kept, top 3,
    # two shared experts, raw (not renormalized) weights, tied embeddings.
    "plain_q_default_rope": DeepseekV3Config(
        **_BASE,
        q_lora_rank=None,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        n_shared_experts=2,
        routed_scaling_factor=1.5,
        norm_topk_prob=False,
        rope_interleave=False,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}


def tiny_hf(config: DeepseekV3Config, folder: Path) -> PreTrainedModel:
    """A seeded random HF model with random norms, a decisive router and a random expert bias
    (HF inits it to zero, which would hide a dropped or misapplied bias), saved."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    randomize_norms(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # clear top-k margins: no near-tie flips
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.3, 0.3)
    model.save_pretrained(folder)
    return model.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers(case: str, tmp_path: Path) -> None:
    hf = tiny_hf(CASES[case], tmp_path)
    native = load_hf(tmp_path)
    assert type(native) is DeepseekV3Transformer
    # transformers' class has no aux loss: ours must be off by default to match its loss.
    assert native.args.router_aux_loss_coef == 0.0
    check_forward_and_grads(hf, native)


@pytest.mark.parametrize("case", list(CASES))
def test_expert_bias_changes_the_choice(case: str, tmp_path: Path) -> None:
    """The parity inputs route differently with and without the bias, so parity covers it."""
    tiny_hf(CASES[case], tmp_path)
    native = load_hf(tmp_path)
    chosen = []
    router = native.layers[1].feed_forward.router
    router.register_forward_hook(lambda module, args, out: chosen.append(out[2]))
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        native(ids)
        router.expert_bias.zero_()
        native(ids)
    biased, plain = (c.sort(dim=-1).values for c in chosen)
    assert (biased != plain).any(dim=-1).float().mean() > 0.2


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_is_bit_identical(case: str, tmp_path: Path) -> None:
    hf = tiny_hf(CASES[case], tmp_path / "hf")
    check_round_trip(tmp_path / "hf", tmp_path / "out", hf)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").config
    for field in (
        "q_lora_rank",
        "n_group",
        "topk_group",
        "n_shared_experts",
        "routed_scaling_factor",
        "first_k_dense_replace",
        "norm_topk_prob",
        "rope_interleave",
        "tie_word_embeddings",
    ):
        assert getattr(reloaded, field) == getattr(hf.config, field), field
    # Rope settings may be spelled differently (explicit YaRN defaults): same meaning.
    assert read_hf_args(tmp_path / "out") == read_hf_args(tmp_path / "hf")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["scoring_func"], written["topk_method"]) == ("sigmoid", "noaux_tc")
    # One tensor per routed expert and projection, as the hub and save_pretrained hold them.
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    assert saved["model.layers.2.mlp.experts.7.down_proj.weight"].shape == (64, 24)
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in saved


def test_missing_expert_bias_is_named(tmp_path: Path) -> None:
    tiny_hf(CASES["plain_q_default_rope"], tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    del tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    broken = tmp_path / "broken"
    broken.mkdir()
    save_file(tensors, broken / "model.safetensors")
    (broken / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    with pytest.raises(ValueError, match=r"missing tensors: .*layers\.1\.mlp\.gate\.e_score"):
        load_hf(broken)


def test_router_bias_update_survives_the_round_trip(tmp_path: Path) -> None:
    """The bias is state a run changes: a saved model carries the updated values."""
    tiny_hf(CASES["plain_q_default_rope"], tmp_path / "hf")
    native = load_hf(tmp_path / "hf")
    native(torch.randint(0, 96, (2, 24)))
    routers = [m.router for m in moe_layers(native).values()]
    update_expert_bias(routers, 0.25)
    save_hf(native, tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for i, router in zip((1, 2), routers, strict=True):
        theirs = reloaded.model.layers[i].mlp.gate.e_score_correction_bias
        assert torch.equal(theirs, router.expert_bias)
