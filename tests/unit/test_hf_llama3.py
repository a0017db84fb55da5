"""Llama 3 against transformers' LlamaForCausalLM, and HF folders in and out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_parity import check_forward_and_grads, check_round_trip, randomize_norms
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from temper.models import load_hf, save_hf
from temper.models.hf import read_hf_args
from temper.models.llama3 import LlamaArgs, Transformer
from temper.models.safetensors_io import INDEX_FILE

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # 64 puts head_dim 16's frequencies in all three scaling bands.
    "original_max_position_embeddings": 64,
}


def tiny_llama(folder: Path, **overrides: object) -> LlamaForCausalLM:
    config = LlamaConfig(
        **{
            "vocab_size": 96,
            "hidden_size": 64,
            "intermediate_size": 80,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
            "rope_parameters": LLAMA3_ROPE,
            "tie_word_embeddings": False,
            **overrides,
        }
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    randomize_norms(model)
    with torch.no_grad():  # HF inits biases to zero; random ones catch a dropped bias
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.uniform_(-0.1, 0.1)
    model.save_pretrained(folder)
    return model.eval()


CASES = {
    "gqa_untied_llama3_rope": {},
    "tied": {"tie_word_embeddings": True},
    "biases_and_head_dim": {"attention_bias": True, "mlp_bias": True, "head_dim": 24},
    "no_rope_scaling_mha": {
        "num_key_value_heads": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
}


@pytest.mark.parametrize("case", CASES)
def test_matches_transformers(case: str, tmp_path: Path) -> None:
    hf = tiny_llama(tmp_path, **CASES[case])
    native = load_hf(tmp_path)
    assert isinstance(native, Transformer)
    check_forward_and_grads(hf, native)


@pytest.mark.parametrize("case", ["gqa_untied_llama3_rope", "tied", "biases_and_head_dim"])
def test_round_trip_is_bit_identical(case: str, tmp_path: Path) -> None:
    hf = tiny_llama(tmp_path / "hf", **CASES[case])
    check_round_trip(tmp_path / "hf", tmp_path / "out", hf)
    assert (tmp_path / "out" / INDEX_FILE).is_file()  # small shard limit forces several files
    assert (tmp_path / "out" / "generation_config.json").is_file()


def test_args_from_hf_config(tmp_path: Path) -> None:
    tiny_llama(tmp_path, tie_word_embeddings=True)
    spec, args = read_hf_args(tmp_path)
    assert spec.name == "llama3"
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads) == (64, 2, 4, 2)
    assert args.tie_embeddings and args.rope_scaling.original_max_position_embeddings == 64


def test_old_style_rope_fields_are_read(tmp_path: Path) -> None:
    tiny_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope  # the transformers 4.x layout of hub configs
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = read_hf_args(tmp_path)[1]
    assert args.rope_theta == 500000.0 and args.rope_scaling.factor == 8.0


def test_unsupported_rope_and_model_type_are_named(tmp_path: Path) -> None:
    tiny_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match="config.json: cannot read a llama3 config: rope type 'yarn'"
    ):
        read_hf_args(tmp_path)
    config["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported; supported: .*llama"):
        read_hf_args(tmp_path)


def test_missing_and_misshaped_tensors_are_all_named(tmp_path: Path) -> None:
    tiny_llama(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    del tensors["model.norm.weight"]
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError) as error:
        load_hf(tmp_path)
    message = str(error.value)
    assert "model.layers.1.mlp.up_proj.weight" in message and "model.norm.weight" in message
    assert "model.layers.0.self_attn.k_proj.weight has shape (3, 64), expected (32, 64)" in message


def test_sharded_folder_reads_like_a_single_file(tmp_path: Path) -> None:
    hf = tiny_llama(tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / INDEX_FILE).is_file()
    one, sharded = load_hf(tmp_path / "one"), load_hf(tmp_path / "sharded")
    for (name, a), (_, b) in zip(
        one.state_dict().items(), sharded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_dtype_and_extra_config(tmp_path: Path) -> None:
    tiny_llama(tmp_path / "hf")
    model = load_hf(tmp_path / "hf", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    save_hf(model, tmp_path / "out", extra_config={"eos_token_id": 5, "bos_token_id": 4})
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["eos_token_id"] == 5
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 4, "eos_token_id": 5}


def test_native_flavor_exports_to_transformers(tmp_path: Path) -> None:
    """A model trained from scratch (a flavor, not an HF folder) becomes an HF folder."""
    torch.manual_seed(0)
    args = LlamaArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=50, ffn_hidden_dim=48)
    with torch.device("meta"):
        native = Transformer(args)
    native.to_empty(device="cpu")
    native.init_weights()
    save_hf(native, tmp_path)
    hf = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 50, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, native(ids), rtol=1e-5, atol=1e-6)
