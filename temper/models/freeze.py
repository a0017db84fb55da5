"""Freezing whole parts of a model (``--model.freeze``): a vision-language model's tower, its
patch merger, or its language model keep their weights while the rest trains."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

PARTS = ("vision", "merger", "language")
_VISION = ("visual.patch_embed.", "visual.pos_embed.", "visual.blocks.")


def part_of(name: str) -> str:
    """The part a parameter belongs to: vision (the tower before its merger), merger, or
    language (everything else)."""
    if name.startswith(_VISION):
        return "vision"
    return "merger" if name.startswith("visual.merger.") else "language"


def freeze_parts(model: nn.Module, parts: Sequence[str]) -> None:
    """Stop the gradients of every parameter in ``parts`` (LoRA adapters included)."""
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"model.freeze {unknown[0]!r} is not a part; choose from {PARTS}")
    names = [name for name, _ in model.named_parameters()]
    if {"vision", "merger"} & set(parts) and all(part_of(n) == "language" for n in names):
        raise ValueError(
            f"model.freeze {sorted(parts)}: {type(model).__name__} has no vision tower"
        )
    for name, param in model.named_parameters():
        if part_of(name) in parts:
            param.requires_grad_(False)
