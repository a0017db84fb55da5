"""DeepSeek V4 folders as the hub releases them: DeepSeek's own tensor names, block-scaled FP8
weights and FP4 routed experts (``temper.models.quantized``), read into Temper."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_parity import max_rel_err
from safetensors.torch import load_file, save_file
from test_deepseek_v4 import _ties_decided_alike, tiny_hf  # noqa: F401 (fixture)
from transformers import AutoModelForCausalLM, FineGrainedFP8Config

from temper.models import load_hf
from temper.models.quantized import BlockScaledFolder
from temper.models.safetensors_io import SafetensorsFolder

BLOCK = 8
FP8 = ("layers.0.attn.wq_a.weight", "layers.1.attn.wo_b.weight", "head.weight")
FP4 = tuple(f"layers.1.ffn.experts.{e}.{w}.weight" for e in range(4) for w in ("w1", "w3"))
FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0]
FP4_VALUES += [-4.0, -6.0]


def hub_name(name: str) -> str:
    """transformers' saved name -> the released checkpoint's (written out by hand here)."""
    fixed = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}
    if name in fixed:
        return fixed[name]
    if name.startswith("model.hc_head.hc_"):
        return "hc_head_" + name.removeprefix("model.hc_head.hc_")
    return name.removeprefix("model.")


def write_folder(folder: Path, tensors: dict[str, torch.Tensor], config: Path, **extra) -> None:
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    hf_config = json.loads(config.read_text()) | extra
    (folder / "config.json").write_text(json.dumps(hf_config))


def fp8_quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 codes, fp32 per-block scales, the float64 dequantization) of ``weight``, blocks of
    BLOCK x BLOCK with ragged edges."""
    rows, cols = weight.shape
    grid = (-(-rows // BLOCK), -(-cols // BLOCK))
    scale = torch.empty(grid)
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    exact = torch.empty(rows, cols, dtype=torch.float64)
    for i in range(grid[0]):
        for j in range(grid[1]):
            r, c = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            scale[i, j] = weight[r, c].abs().max() / 448.0
            codes[r, c] = (weight[r, c] / scale[i, j]).to(torch.float8_e4m3fn)
            exact[r, c] = codes[r, c].double() * scale[i, j].double()
    return codes, scale, exact


def fp4_quantized(
    shape: tuple[int, int], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed int8 codes, e8m0 scales per row and 16 columns, the float64 values) of random
    e2m1 codes: a low nibble is the even column, the high nibble the odd one."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = shape
    codes = torch.randint(0, 16, (rows, cols), generator=g)
    exponents = torch.randint(-4, 1, (rows, cols // 16), generator=g)
    exact = torch.tensor(FP4_VALUES, dtype=torch.float64)[codes]
    for r in range(rows):
        for c in range(cols):
            exact[r, c] *= 2.0 ** exponents[r, c // 16].item()
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    scale = (2.0 ** exponents.float()).to(torch.float8_e8m0fnu)
    return packed, scale, exact


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """transformers' folder, its hub-named copy, a quantized hub-named copy, and the
    transformers-named folder of the quantized copy's dequantized weights."""
    root = tmp_path_factory.mktemp("v4hub")
    tiny_hf(root / "hf")
    config = root / "hf" / "config.json"
    saved = load_file(root / "hf" / "model.safetensors")
    write_folder(root / "raw", {hub_name(k): v for k, v in saved.items()}, config)
    quantized, dequantized = {hub_name(k): v for k, v in saved.items()}, dict(saved)
    by_hub = {hub_name(k): k for k in saved}
    for i, name in enumerate(FP8 + FP4):
        if name in FP8:
            codes, scale, exact = fp8_quantized(quantized[name].float())
        else:
            codes, scale, exact = fp4_quantized(tuple(quantized[name].shape), i)
        quantized[name] = codes
        quantized[name.removesuffix("weight") + "scale"] = scale
        dequantized[by_hub[name]] = exact.float()
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK]}
    write_folder(root / "quantized", quantized, config, quantization_config=quant)
    write_folder(root / "dequantized", dequantized, config)
    return {name: root / name for name in ("hf", "raw", "quantized", "dequantized")}


def test_hub_names_load_bit_identical_to_transformers_names(folders: dict[str, Path]) -> None:
    expected = load_hf(folders["hf"]).state_dict()
    got = load_hf(folders["raw"]).state_dict()
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_quantized_weights_dequantize_exactly_and_match_transformers(
    folders: dict[str, Path],
) -> None:
    native = load_hf(folders["quantized"]).eval()
    # The hand dequantization (float64, rounded once to the model's fp32), read as it is.
    reference = load_hf(folders["dequantized"]).state_dict()
    for name, value in native.state_dict().items():
        assert torch.equal(value, reference[name]), name
    hf_model = AutoModelForCausalLM.from_pretrained(folders["dequantized"]).eval()
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert max_rel_err(native(ids), hf_model(ids).logits) < 1e-5


def test_transformers_dequantizes_the_same_values(folders: dict[str, Path]) -> None:
    """transformers' own CPU dequantization of the quantized hub folder agrees, except where it
    departs from DeepSeek's layout: it takes a block as rows / scale rows, so the ragged
    ``wq_a`` (12 rows, blocks of 8) comes out otherwise, and it leaves an FP8 ``head.weight``
    unrenamed (unloaded)."""
    quantized = FineGrainedFP8Config(dequantize=True)
    theirs = AutoModelForCausalLM.from_pretrained(
        folders["quantized"], quantization_config=quantized, dtype=torch.float32
    ).state_dict()
    expected = AutoModelForCausalLM.from_pretrained(folders["dequantized"]).state_dict()
    departs = {"model.layers.0.self_attn.q_a_proj.weight", "lm_head.weight"}
    assert "model.layers.1.mlp.experts.gate_up_proj" in expected
    for name, value in expected.items():
        assert name in departs or torch.equal(theirs[name], value), name


def test_an_unsupported_quantization_is_named(folders: dict[str, Path], tmp_path: Path) -> None:
    tensors = load_file(folders["raw"] / "model.safetensors")
    write_folder(
        tmp_path / "q",
        tensors,
        folders["hf"] / "config.json",
        quantization_config={"quant_method": "gptq"},
    )
    with pytest.raises(ValueError, match="quant_method 'gptq' is not supported"):
        load_hf(tmp_path / "q")


def test_a_sharded_read_dequantizes_only_its_rows(tmp_path: Path) -> None:
    """transformers' (and DeepSeek V3's) ``weight_scale_inv`` spelling, rows cut inside a
    ragged block as a dim-0 shard reads them."""
    weight = torch.randn(19, 13, generator=torch.Generator().manual_seed(1))
    codes, scale, exact = fp8_quantized(weight)
    tmp_path.mkdir(exist_ok=True)
    save_file({"w.weight": codes, "w.weight_scale_inv": scale}, tmp_path / "model.safetensors")
    tensors = BlockScaledFolder(SafetensorsFolder(tmp_path), (BLOCK, BLOCK))
    assert tensors.keys() == ["w.weight"] and tensors.shape("w.weight") == (19, 13)
    assert torch.equal(tensors.read("w.weight"), exact.float())
    assert torch.equal(tensors.read("w.weight", slice(5, 18)), exact[5:18].float())
