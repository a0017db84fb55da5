"""Qwen3.5 and Qwen3.5-MoE vision-language models against transformers'
`Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration`, through HF folders.

fp32, tiny random configs, real images (Pillow drawings through transformers' own image
processor): the tower's features, the whole model's logits and loss, and every gradient
within 1e-5; the multimodal rotary positions equal `get_rope_index` with several images per
row and in packed rows; the export loads in `AutoModelForImageTextToText` with equal logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_parity import checkpoint_grads, max_rel_err, randomize_norms
from PIL import Image, ImageDraw
from safetensors.torch import load_file
from transformers import (
    AutoModelForImageTextToText,
    PreTrainedModel,
    Qwen3_5Config,
    Qwen3_5MoeConfig,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from temper.data.mrope_positions import mrope_positions
from temper.models import load_hf, save_hf
from temper.models.hf import adapter_of
from temper.models.qwen3_5_vl import Qwen3_5MoeVLTransformer, Qwen3_5VLTransformer

TEXT = {
    "vocab_size": 96,
    "hidden_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 12,
    "linear_value_head_dim": 8,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
}
MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 40,
}
VISION = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 48,
    "num_position_embeddings": 16,
}
TOKENS = {
    "image_token_id": 90,
    "video_token_id": 91,
    "vision_start_token_id": 92,
    "vision_end_token_id": 93,
}
IMAGE, START, END = 90, 92, 93


def config(moe: bool) -> Qwen3_5Config | Qwen3_5MoeConfig:
    if moe:
        return Qwen3_5MoeConfig(text_config=TEXT | MOE, vision_config=VISION, **TOKENS)
    return Qwen3_5Config(
        text_config=TEXT | {"intermediate_size": 56}, vision_config=VISION, **TOKENS
    )


def tiny_vlm(moe: bool, folder: Path) -> PreTrainedModel:
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config(moe))
    randomize_norms(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") and "dt_bias" not in name:
                param.uniform_(-0.1, 0.1)
            elif name.endswith("A_log"):  # slow decays, as in the text parity tests
                param.copy_(torch.empty_like(param).uniform_(0.05, 1.0).log())
            elif name.endswith("pos_embed.weight"):
                param.normal_(0.0, 1.0)
    model.save_pretrained(folder)
    return model.eval()


def drawing(width: int, height: int, seed: int) -> Image.Image:
    """A coloured shape on a coloured ground, as the synthetic task draws them."""
    g = torch.Generator().manual_seed(seed)
    colour = tuple(torch.randint(0, 256, (3,), generator=g).tolist())
    image = Image.new(
        "RGB", (width, height), tuple(torch.randint(0, 256, (3,), generator=g).tolist())
    )
    ImageDraw.Draw(image).ellipse((2, 3, width - 3, height - 2), fill=colour)
    return image


def images(sizes: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """pixel_values and image_grid_thw from transformers' Pillow image processor."""
    processor = Qwen2VLImageProcessorPil(
        patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8, max_pixels=32 * 32
    )
    out = processor([drawing(w, h, i) for i, (w, h) in enumerate(sizes)], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def image_tokens(grid: torch.Tensor) -> list[int]:
    return [START] + [IMAGE] * int(grid.prod() // 4) + [END]


def batch(grids: torch.Tensor) -> torch.Tensor:
    """Two rows of 40 tokens: row 0 holds images 0 and 1 between text, row 1 image 2."""
    g = torch.Generator().manual_seed(1)
    text = lambda n: torch.randint(0, 89, (n,), generator=g).tolist()  # noqa: E731
    rows = [
        text(3) + image_tokens(grids[0]) + text(4) + image_tokens(grids[1]),
        text(5) + image_tokens(grids[2]),
    ]
    width = 40
    return torch.tensor([r + text(width - len(r)) for r in rows])


def mm_token_types(ids: torch.Tensor) -> torch.Tensor:
    return (ids == IMAGE).int()


SIZES = [(16, 16), (24, 16), (16, 32)]  # 2x2, 2x3 and 4x2 merged grids (8x8 min, 4-pixel patches)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_matches_transformers_with_images(moe: bool, tmp_path: Path) -> None:
    hf = tiny_vlm(moe, tmp_path)
    native = load_hf(tmp_path)
    assert type(native) is (Qwen3_5MoeVLTransformer if moe else Qwen3_5VLTransformer)
    pixels, grids = images(SIZES)
    ids = batch(grids)

    with torch.no_grad():  # the tower alone
        want = hf.model.visual(pixels, grid_thw=grids).pooler_output
        assert max_rel_err(native.visual(pixels, grids, native.kernels), want) <= 1e-5

    hf_out = hf(
        input_ids=ids,
        pixel_values=pixels,
        image_grid_thw=grids,
        mm_token_type_ids=mm_token_types(ids),
        labels=ids,
    )
    logits = native(ids, pixel_values=pixels, image_grid_thw=grids)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert max_rel_err(logits.detach(), hf_out.logits.detach()) <= 1e-5
    if not moe:  # the MoE's HF loss carries no aux term here (output_router_logits off)
        assert abs(loss.item() - hf_out.loss.item()) <= 1e-6 * abs(hf_out.loss.item())
    F.cross_entropy(hf_out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    loss.backward()
    params = dict(native.named_parameters(remove_duplicate=False))
    hf_grads = checkpoint_grads(hf)
    checked = 0
    for rule in adapter_of(native).key_rules(native.args):
        expected = torch.stack([hf_grads[k] for k in rule.hf])
        expected = expected if len(rule.hf) > 1 else expected[0]
        err = max_rel_err(params[rule.native].grad, expected)
        assert err <= 1e-5, f"gradient of {rule.native} off by {err:.2e}"
        checked += rule.native.startswith("visual.")
    assert checked == len([n for n in params if n.startswith("visual.")])


def test_mrope_positions_equal_get_rope_index(tmp_path: Path) -> None:
    """Several images in a row, and a packed row of two documents (each as its own sequence
    for transformers), with the text positions restarting at the second."""
    hf = AutoModelForImageTextToText.from_config(config(False))
    _, grids = images(SIZES)
    ids = batch(grids)
    want, _ = hf.model.get_rope_index(ids, mm_token_types(ids), image_grid_thw=grids)
    assert torch.equal(mrope_positions(ids, grids, IMAGE, 2), want)

    packed = torch.cat([ids[1, :20], ids[0]])[None]  # document 1 (image 2), then document 0
    positions = torch.cat([torch.arange(20), torch.arange(40)])[None]
    packed_grids = torch.cat([grids[2:], grids[:2]])
    first, _ = hf.model.get_rope_index(ids[1:, :20], mm_token_types(ids[1:, :20]), grids[2:])
    second, _ = hf.model.get_rope_index(ids[:1], mm_token_types(ids[:1]), grids[:2])
    got = mrope_positions(packed, packed_grids, IMAGE, 2, positions)
    assert torch.equal(got, torch.cat([first, second], dim=2))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_export_loads_as_the_full_model(moe: bool, tmp_path: Path) -> None:
    """HF -> Temper -> HF keeps every tensor bit for bit (tower included), and transformers'
    `AutoModelForImageTextToText` loads the export with Temper's logits on an image prompt."""
    hf = tiny_vlm(moe, tmp_path / "hf")
    native = load_hf(tmp_path / "hf")
    save_hf(native, tmp_path / "out")
    original = {
        k: v for f in (tmp_path / "hf").glob("*.safetensors") for k, v in load_file(f).items()
    }
    written = {
        k: v for f in (tmp_path / "out").glob("*.safetensors") for k, v in load_file(f).items()
    }
    assert written.keys() == original.keys(), set(written) ^ set(original)
    assert all(torch.equal(written[k], v) for k, v in original.items())
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "out").eval()
    assert type(reloaded) is type(hf)
    pixels, grids = images(SIZES)
    ids = batch(grids)
    with torch.no_grad():
        got = reloaded(
            input_ids=ids,
            pixel_values=pixels,
            image_grid_thw=grids,
            mm_token_type_ids=mm_token_types(ids),
        ).logits
        assert max_rel_err(got, native(ids, pixel_values=pixels, image_grid_thw=grids)) <= 1e-5


def test_checkpoint_export_carries_processor_and_mtp(tmp_path: Path) -> None:
    """A released-style folder (tokenizer, image processor, `mtp.*` tensors Temper does not
    model) -> DCP checkpoint -> HF export: the processor files and the MTP tensors arrive
    untouched, and transformers loads the export as the full model with the folder's logits."""
    from importlib import resources

    from safetensors.torch import save_file

    from temper.checkpoint.convert import dcp_to_hf, hf_to_dcp

    hf = tiny_vlm(False, tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    mtp = {"mtp.fc.weight": torch.randn(48, 96), "mtp.norm.weight": torch.rand(48)}
    save_file(load_file(weights) | mtp, weights, metadata={"format": "pt"})
    tokenizer = resources.files("temper.assets").joinpath("tokenizer.json").read_text()
    (tmp_path / "hf" / "tokenizer.json").write_text(tokenizer)
    processor = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2)
    processor.save_pretrained(tmp_path / "hf")

    hf_to_dcp(tmp_path / "hf", tmp_path / "ckpt")
    dcp_to_hf(tmp_path / "ckpt", tmp_path / "out")
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(written[k], v) for k, v in mtp.items())
    preprocessor = (tmp_path / "hf" / "preprocessor_config.json").read_text()
    assert (tmp_path / "out" / "preprocessor_config.json").read_text() == preprocessor
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "out").eval()
    pixels, grids = images(SIZES)
    ids = batch(grids)
    inputs = dict(input_ids=ids, pixel_values=pixels, image_grid_thw=grids)
    with torch.no_grad():
        got = reloaded(**inputs, mm_token_type_ids=mm_token_types(ids)).logits
        want = hf(**inputs, mm_token_type_ids=mm_token_types(ids)).logits
    assert max_rel_err(got, want) <= 1e-5
