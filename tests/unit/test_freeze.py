"""``--model.freeze``: which weights stop training, the errors, and its place in temper.json."""

from __future__ import annotations

import pytest
import torch

from temper.checkpoint.metadata import run_structure, structure_differences
from temper.config import Config, ConfigError, Model
from temper.data.tokenizer import load_tokenizer
from temper.engine.engine import build_run_model
from temper.models.freeze import part_of


def trainable(parts: list[str], name: str = "qwen3_5_vl", lora: bool = False) -> dict[str, bool]:
    config = Config(model=Model(name=name, flavor="debug", freeze=parts))
    config.lora.enable = lora
    config.lora.target_modules = ["all-linear"]
    model = build_run_model(config, load_tokenizer(None))
    return {n: p.requires_grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("parts", [["vision"], ["merger"], ["language"], ["vision", "language"]])
def test_frozen_parts_stop_training(parts: list[str]) -> None:
    grads = trainable(parts)
    assert {part_of(n) for n in grads} == {"vision", "merger", "language"}
    for name, trains in grads.items():
        assert trains == (part_of(name) not in parts), name
    assert part_of("visual.blocks.0.attn.qkv.weight") == "vision"
    assert part_of("visual.merger.linear_fc1.weight") == "merger"
    assert part_of("layers.0.attention.wq.weight") == "language"


def test_lora_adapters_of_a_frozen_part_stay_frozen() -> None:
    """LoRA on every linear layer, the tower frozen: only the language model's adapters train."""
    grads = trainable(["vision"], lora=True)
    training = [n for n, t in grads.items() if t]
    assert training and all("lora_" in n for n in training)
    assert any(n.startswith("visual.merger.") for n in training)
    assert not any(part_of(n) == "vision" for n in training)


def test_a_text_model_has_no_tower_to_freeze() -> None:
    with pytest.raises(ConfigError, match=r"model.freeze \['vision'\]: .* has no vision tower"):
        trainable(["vision"], name="qwen3_5")


def test_freeze_is_recorded_and_checked_on_resume() -> None:
    model = {"family": "qwen3_5_vl", "args": {}}
    plain = {"model": model, "structure": run_structure(1, None, torch.float32)}
    frozen = {"model": model, "structure": run_structure(1, None, torch.float32, ["vision"])}
    assert "freeze" not in plain["structure"]  # earlier checkpoints still match
    assert structure_differences(frozen, plain) == [
        "structure.freeze: checkpoint ['vision'], config None"
    ]
    assert structure_differences(frozen, frozen) == []


def test_image_data_needs_a_vision_language_model() -> None:
    config = Config(model=Model(name="qwen3_5", flavor="debug"))
    config.data.format, config.data.builtin_images = "sft", True
    with pytest.raises(ConfigError, match=r"built-in image task\) holds images, but .* tower"):
        build_run_model(config, load_tokenizer(None))
