"""Post-training under FSDP2 trains like one process: LoRA SFT, LoRA DPO (reference = adapters
off) and full DPO (reference = a frozen copy sharded like the policy)."""

from __future__ import annotations

from pathlib import Path

import pytest
from training import FSDP2, SINGLE, assert_same_metrics, parity_config, train

from temper.config import Config
from temper.recipes.posttrain import dpo_debug, sft_debug

pytestmark = pytest.mark.slow


def _lora_sft() -> Config:
    config = sft_debug()
    config.lora.enable = True
    return config


def _dpo_frozen_copy() -> Config:
    config = dpo_debug()
    config.lora.enable = False  # the reference is a frozen copy, sharded like the policy
    return config


@pytest.mark.parametrize(
    "recipe", [_lora_sft, dpo_debug, _dpo_frozen_copy], ids=["sft", "dpo", "dpo_frozen_copy"]
)
def test_lora_fsdp2_equals_one_process(recipe, tmp_path: Path) -> None:
    runs = []
    for layout in (SINGLE, FSDP2):
        config = parity_config(recipe, tmp_path / recipe.__name__, layout)
        config.training.steps = 3
        runs.append(train(config, layout))
    single, sharded = runs
    assert sharded.fsdp_units  # the adapters (or the whole policy) were sharded
    assert_same_metrics(sharded.rows, single.rows)
    # Adapters moved the model: the loss changed after the first step.
    assert single.rows[-1]["loss"] != single.rows[0]["loss"]
