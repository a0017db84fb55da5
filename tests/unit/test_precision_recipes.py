"""The precision recipes load through the CLI path and pass their config rules (FP8 with
emulation here: this machine may lack float8 tensor cores)."""

from __future__ import annotations

import pytest

from temper.config import load_config


@pytest.mark.parametrize(
    ("recipe", "extra"),
    [
        ("llama3_debug_float8", ["--quantize.float8.emulate"]),
        ("llama3_debug_adamw8bit", []),
        ("sft_debug_qat", []),
        ("sft_debug_qlora", []),
    ],
)
def test_precision_recipes_validate(recipe: str, extra: list[str]) -> None:
    config = load_config("temper.recipes.precision", recipe, extra)
    config.validate(1)
    on = {
        "llama3_debug_float8": config.quantize.float8.enable,
        "llama3_debug_adamw8bit": config.optimizer.name == "adamw8bit",
        "sft_debug_qat": config.qat.enable,
        "sft_debug_qlora": config.lora.quantize_base == "nf4",
    }
    assert on[recipe]
