"""The protocols in temper.models.protocols say what each registered family offers, so the
Engine and the losses ask them instead of naming a family."""

from __future__ import annotations

import pytest

import temper.models  # noqa: F401  (registers the families)
from temper.models.protocols import VisionModel
from temper.models.registry import build_model, model_names

VISION_FAMILIES = {"qwen3_5_vl", "qwen3_5_moe_vl"}


@pytest.mark.parametrize("family", model_names())
def test_vision_model_is_the_families_with_a_vision_tower(family: str) -> None:
    model = build_model(family, "debug")  # meta: shapes only
    assert isinstance(model, VisionModel) == (family in VISION_FAMILIES)
