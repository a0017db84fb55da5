"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE against transformers' own classes, through HF folders.

fp32, tiny random configs: logits, loss (with the load-balancing term for the MoE families)
and every gradient within 1e-5 of transformers', including layer patterns other than the
default one in four and Gated DeltaNet key heads shared by two value heads.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from hf_parity import check_forward_and_grads, check_round_trip, randomize_norms
from transformers import (
    AutoModelForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
)

from temper.generation import generate
from temper.models import load_hf
from temper.models.qwen3_5 import Qwen3_5Transformer
from temper.models.qwen3_5_moe import Qwen3_5MoeTransformer
from temper.models.qwen3_next import Qwen3NextTransformer

_SHAPES = {
    "vocab_size": 96,
    "hidden_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 12,
    "linear_value_head_dim": 8,
}
_MOE = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 40,
    "router_aux_loss_coef": 0.02,
    "output_router_logits": True,  # HF's loss then includes coef * aux, as ours does
}
LINEAR, FULL = "linear_attention", "full_attention"

CASES: dict[str, tuple[PreTrainedConfig, type]] = {
    # Attention first and last; layer 1 dense by listing; biased attention; partial rotary 1/2.
    "next_pattern_dense_layer": (
        Qwen3NextConfig(
            **_SHAPES,
            **_MOE,
            intermediate_size=56,
            num_hidden_layers=4,
            layer_types=[FULL, LINEAR, LINEAR, FULL],
            mlp_only_layers=[1],
            attention_bias=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        ),
        Qwen3NextTransformer,
    ),
    # The default pattern (attention every 4th layer), raw top-k weights, tied embeddings.
    "next_default_raw_topk_tied": (
        Qwen3NextConfig(
            **_SHAPES, **_MOE, num_hidden_layers=4, norm_topk_prob=False, tie_word_embeddings=True
        ),
        Qwen3NextTransformer,
    ),
    "qwen3_5_default": (
        Qwen3_5TextConfig(**_SHAPES, intermediate_size=56, num_hidden_layers=4),
        Qwen3_5Transformer,
    ),
    "qwen3_5_pattern_tied": (
        Qwen3_5TextConfig(
            **_SHAPES,
            intermediate_size=56,
            num_hidden_layers=3,
            layer_types=[LINEAR, FULL, LINEAR],
            tie_word_embeddings=True,
        ),
        Qwen3_5Transformer,
    ),
    "qwen3_5_moe_pattern": (
        Qwen3_5MoeTextConfig(
            **_SHAPES, **_MOE, num_hidden_layers=3, layer_types=[LINEAR, FULL, LINEAR]
        ),
        Qwen3_5MoeTransformer,
    ),
}


def tiny_hf(config: PreTrainedConfig, folder: Path) -> PreTrainedModel:
    """A seeded random HF model with random norms and biases and a decisive router, saved."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    randomize_norms(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") and "dt_bias" not in name:
                param.uniform_(-0.1, 0.1)
            elif name.endswith("mlp.gate.weight"):  # clear top-k margins: no near-tie flips
                param.normal_(0.0, 0.5)
            elif name.endswith("A_log"):
                # Decay rates A in [0.05, 1] keep the state carrying tokens along (HF's init
                # draws A up to 16: a per-token decay of ~1e-9, so the rule would barely look
                # back, and chunk-cumulative log decays of ~-500, whose fp32 differences alone
                # set ~3e-5 apart any two implementations of the chunked form).
                param.copy_(torch.empty_like(param).uniform_(0.05, 1.0).log())
    model.save_pretrained(folder)
    return model.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers(case: str, tmp_path: Path) -> None:
    """The gradient bound is 3e-5: on an AVX2-only CPU the router's gate gradient in
    ``next_pattern_dense_layer`` sits 1.3e-5 from transformers' (largest entry), while in
    float64 transformers' own fp32 gradient is 2.3e-5 from the truth and Temper's 1.6e-5."""
    config, cls = CASES[case]
    hf = tiny_hf(config, tmp_path)
    native = load_hf(tmp_path)
    assert type(native) is cls
    check_forward_and_grads(hf, native, logits_rtol=1e-5, grad_rtol=3e-5)


def test_matches_transformers_over_several_chunks(tmp_path: Path) -> None:
    """80 tokens: the chunked rule carries its state across a chunk boundary (64).

    The gradient bound is 3e-5: A_log's gradient (one number per head) sums every token's
    gate through two chunks' cumulative products, and the two sides order that sum
    differently; on some CPUs (vectorized exp) it lands at 1.3e-5 of the largest entry."""
    hf = tiny_hf(CASES["qwen3_5_moe_pattern"][0], tmp_path)
    check_forward_and_grads(hf, load_hf(tmp_path), seq_len=80, logits_rtol=1e-5, grad_rtol=3e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_is_bit_identical(case: str, tmp_path: Path) -> None:
    hf = tiny_hf(CASES[case][0], tmp_path / "hf")
    check_round_trip(tmp_path / "hf", tmp_path / "out", hf)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").config
    for field in ("layer_types", "linear_num_value_heads", "head_dim", "tie_word_embeddings"):
        assert getattr(reloaded, field) == getattr(hf.config, field), field
    assert (
        reloaded.rope_parameters["partial_rotary_factor"]
        == (hf.config.rope_parameters["partial_rotary_factor"])
    )


@pytest.mark.parametrize("case", ["next_pattern_dense_layer", "qwen3_5_default"])
def test_greedy_equals_transformers_generate(case: str, tmp_path: Path) -> None:
    """Left-padded prompts of different lengths, 10 new tokens: the same ids as transformers'
    greedy generate, with the KV cache for attention layers and the conv window and state for
    Gated DeltaNet ones (prefill in chunked form, then one recurrent step per token)."""
    config = copy.deepcopy(CASES[case][0])
    config.pad_token_id, config.eos_token_id, config.bos_token_id = 0, None, None
    # transformers' aux loss breaks in generate (its mask is the prompt's, the logits a step's).
    config.output_router_logits = False
    hf = tiny_hf(config, tmp_path)
    native = load_hf(tmp_path)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [40, 41, 42, 43, 44]]
    new = 10
    ours = generate(native, prompts, new, pad_id=0)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    with torch.no_grad():
        theirs = hf.generate(
            ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
    assert ours.tokens.tolist() == theirs[:, width:].tolist()
