"""Qwen3 and Qwen3-MoE against transformers' own classes, through HF folders on disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_parity import check_forward_and_grads, check_round_trip, randomize_norms
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3MoeConfig,
)

from temper.data.batch import IGNORE_INDEX
from temper.models import load_hf
from temper.models.qwen3 import Qwen3Transformer
from temper.models.qwen3_moe import Qwen3MoeTransformer
from temper.objectives import CausalLM

DENSE = {
    # 8 query heads on 2 kv heads; head_dim 24 while hidden / heads = 8.
    "tied_gqa4": Qwen3Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=24,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # Untied head, attention biases, head_dim 32 while hidden / heads = 12.
    "untied_bias": Qwen3Config(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
}
_MOE = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 80,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.02,
    "output_router_logits": True,  # HF's loss then includes coef * aux, as ours does
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}
MOE = {
    # Layers 1 and 3 sparse, 0 and 2 dense.
    "moe_norm_topk_step2": Qwen3MoeConfig(
        **_MOE, num_hidden_layers=4, norm_topk_prob=True, decoder_sparse_step=2
    ),
    # Layer 1 dense by listing; layers 0 and 2 sparse.
    "moe_raw_topk_mlp_only": Qwen3MoeConfig(
        **_MOE, num_hidden_layers=3, norm_topk_prob=False, mlp_only_layers=[1]
    ),
}


def tiny_hf(config: PreTrainedConfig, folder: Path) -> PreTrainedModel:
    """A seeded random HF model with random norms and biases and a decisive router, saved."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    randomize_norms(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):  # HF inits them to zero; random ones catch a dropped bias
                param.uniform_(-0.1, 0.1)
            elif name.endswith("mlp.gate.weight"):  # clear top-k margins: no near-tie flips
                param.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return model.eval()


@pytest.mark.parametrize("case", [*DENSE, *MOE])
def test_matches_transformers(case: str, tmp_path: Path) -> None:
    hf = tiny_hf({**DENSE, **MOE}[case], tmp_path)
    native = load_hf(tmp_path)
    assert type(native) is (Qwen3MoeTransformer if case in MOE else Qwen3Transformer)
    check_forward_and_grads(hf, native)


@pytest.mark.parametrize("case", [*DENSE, *MOE])
def test_round_trip_is_bit_identical(case: str, tmp_path: Path) -> None:
    hf = tiny_hf({**DENSE, **MOE}[case], tmp_path / "hf")
    check_round_trip(tmp_path / "hf", tmp_path / "out", hf)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").config
    for field in ("head_dim", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
        assert getattr(reloaded, field, None) == getattr(hf.config, field, None), field
    assert getattr(reloaded, "num_experts", None) == getattr(hf.config, "num_experts", None)


@pytest.mark.parametrize("case", list(MOE))
def test_objective_loss_and_aux_metric_equal_transformers(case: str, tmp_path: Path) -> None:
    hf = tiny_hf(MOE[case], tmp_path)
    native = load_hf(tmp_path)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = ids[:, 1:]
    loss_sum, n_tokens, metrics = CausalLM().loss(native, {"input_ids": ids, "labels": labels})
    with torch.no_grad():
        out = hf(ids, labels=ids)
    # HF's loss is the CE mean plus coef * aux; ours is per token, summed.
    torch.testing.assert_close(loss_sum / n_tokens, out.loss, rtol=1e-6, atol=0)
    assert metrics["aux_loss"] == pytest.approx(out.aux_loss.item(), rel=1e-6)


def test_missing_and_misshaped_expert_tensors_are_named(tmp_path: Path) -> None:
    tiny_hf(MOE["moe_norm_topk_step2"], tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    tensors["model.layers.3.mlp.experts.2.down_proj.weight"] = torch.zeros(64, 31)
    broken = tmp_path / "broken"
    broken.mkdir()
    save_file(tensors, broken / "model.safetensors")
    (broken / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    with pytest.raises(ValueError) as err:
        load_hf(broken)
    assert "missing tensors: model.layers.1.mlp.experts.5.up_proj.weight" in str(err.value)
    assert "model.layers.3.mlp.experts.2.down_proj.weight has shape (64, 31)" in str(err.value)
