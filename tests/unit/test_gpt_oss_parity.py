"""gpt-oss against transformers' own `GptOssForCausalLM`, through HF folders on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_parity import check_forward_and_grads, check_round_trip, randomize_norms
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig, Mxfp4Config, PreTrainedModel

from temper.generation import generate
from temper.kernels.attention import DocumentMask
from temper.models import load_hf, save_hf
from temper.models.gpt_oss import GptOssTransformer
from temper.models.hf import open_tensors, read_hf_args
from temper.models.mxfp4 import dequantize

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


def mxfp4_folder(folder: Path) -> PreTrainedModel:
    """The layout of the released checkpoints at a tiny size: the experts' two weights as
    random MXFP4 blocks and scales (exponents 2^-7..2^2), config.json declaring mxfp4."""
    config = GptOssConfig(
        **{**_BASE, "hidden_size": 64, "intermediate_size": 32}, num_hidden_layers=2
    )
    hf = tiny_hf(config, folder)
    tensors = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, cols, rows = tensors.pop(key).shape  # stored transposed, [E, out, in]
        tensors[f"{key}_blocks"] = torch.randint(
            0, 256, (experts, rows, cols // 32, 16), generator=g, dtype=torch.uint8
        )
        tensors[f"{key}_scales"] = torch.randint(
            120, 130, (experts, rows, cols // 32), generator=g, dtype=torch.uint8
        )
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    written = json.loads((folder / "config.json").read_text())
    written["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(written))
    return hf


def test_mxfp4_folder_loads_as_transformers_dequantizes_it(tmp_path: Path) -> None:
    """transformers' own dequantized load (Mxfp4Config(dequantize=True), which runs on CPU
    without the kernels package) and ours hold the same weights and give the same logits;
    the export holds the dequantized tensors and reloads without a quantization config."""
    mxfp4_folder(tmp_path / "mxfp4")
    theirs = AutoModelForCausalLM.from_pretrained(
        tmp_path / "mxfp4", quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    ours = load_hf(tmp_path / "mxfp4")
    for i, layer in enumerate(ours.layers):
        experts = theirs.model.layers[i].mlp.experts
        assert torch.equal(layer.feed_forward.experts.gate_up, experts.gate_up_proj)
        assert torch.equal(layer.feed_forward.experts.down, experts.down_proj)
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=1e-5, atol=1e-5)
    # An expert-parallel rank reads its experts' rows only.
    tensors = open_tensors(tmp_path / "mxfp4")
    key = "model.layers.1.mlp.experts.down_proj"
    assert torch.equal(tensors.read(key, slice(2, 4)), tensors.read(key)[2:4])
    bf16 = load_hf(tmp_path / "mxfp4", dtype=torch.bfloat16)
    gate_up = bf16.layers[0].feed_forward.experts.gate_up
    assert torch.equal(gate_up.float(), ours.layers[0].feed_forward.experts.gate_up)  # exact

    save_hf(ours, tmp_path / "out")
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert not [k for k in written if k.endswith(("_blocks", "_scales"))]
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, theirs(ids).logits, rtol=0, atol=0)


def test_mxfp4_dequantize_by_hand() -> None:
    # One row of 32 values: codes 0x21 -> (1: 0.5, 2: 1.0), 0xF8 -> (8: -0, 15: -6); scale 2^1.
    blocks = torch.tensor([[[[0x21, 0xF8] + [0] * 14]]], dtype=torch.uint8)
    scales = torch.tensor([[[128]]], dtype=torch.uint8)
    values = dequantize(blocks, scales)
    assert values.shape == (1, 32, 1)
    assert values[0, :4, 0].tolist() == [1.0, 2.0, -0.0, -12.0]
    assert values[0, 4:].abs().sum() == 0


@pytest.mark.parametrize("padded", [False, True])
def test_greedy_equals_transformers_generate_past_the_window(padded: bool, tmp_path: Path) -> None:
    """12-token prompts and 16 new tokens, window 8: decoding crosses the window several
    times; the sliding layers hide old cache columns as transformers' sliding cache drops
    them. With ``padded`` the batch is left-padded to the longest prompt."""
    hf = tiny_hf(CASES["yarn_alternating"], tmp_path)
    hf.generation_config.pad_token_id = 0
    native = load_hf(tmp_path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 96, (n,), generator=g).tolist() for n in (12, 9 if padded else 12)]
    new = 16
    ours = generate(native, prompts, new, pad_id=0)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (ids != 0).long() if padded else torch.ones_like(ids)
    with torch.no_grad():
        theirs = hf.generate(
            ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
    assert ours.tokens.tolist() == theirs[:, width:].tolist()


def test_packed_documents_equal_each_document_alone(tmp_path: Path) -> None:
    """Two documents of 23 and 17 tokens in one row (both past the window of 8): sinks,
    windows and rope positions restart per document, so each one's logits are its own."""
    tiny_hf(CASES["yarn_alternating"], tmp_path)
    native = load_hf(tmp_path)
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([[*range(23), *range(17)]])
    with torch.no_grad():
        packed = native(ids, positions, DocumentMask.from_position_ids(positions))
        first, second = native(ids[:, :23]), native(ids[:, 23:])
    torch.testing.assert_close(packed, torch.cat([first, second], dim=1), rtol=1e-5, atol=1e-5)
