"""Llama 3 recipes: plain functions returning a Config; derive by calling and editing."""

from __future__ import annotations

from temper.config import Config, Model
from temper.recipes.shapes import debug_pretrain


def llama3_debug() -> Config:
    """A ~4M-parameter Llama 3 on the built-in synthetic tasks; trains on a CPU in a minute."""
    return debug_pretrain(Model(name="llama3", flavor="debug"))
