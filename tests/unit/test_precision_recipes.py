"""The precision recipes load through the CLI path and pass their config rules (FP8 with
emulation here: this machine may lack float8 tensor cores)."""

from __future__ import annotations

import pytest

from temper.config import load_config


@pytest.mark.parametrize(
    ("recipe", "extra", "world"),
    [
        ("llama3_debug_float8", ["--quantize.float8.emulate"], 1),
        ("llama3_debug_adamw8bit", [], 1),
        ("sft_debug_qat", [], 1),
        ("sft_debug_qlora", [], 1),
        ("sft_debug_qlora", [], 2),  # FSDP2 shards the NF4 base
    ],
)
def test_precision_recipes_validate(recipe: str, extra: list[str], world: int) -> None:
    config = load_config("temper.recipes.precision", recipe, extra)
    config.validate(world)
    on = {
        "llama3_debug_float8": config.quantize.float8.enable,
        "llama3_debug_adamw8bit": config.optimizer.name == "adamw8bit",
        "sft_debug_qat": config.qat.enable,
        "sft_debug_qlora": config.lora.quantize_base == "nf4",
    }
    assert on[recipe]
