"""Regional compilation: `torch.compile` each decoder block, not the whole model.

Blocks share one code path, so one compiled graph serves them all and compile time does
not grow with depth; FSDP's hooks stay outside the compiled region. As with activation
checkpointing, `forward` is replaced in place and parameter names do not change.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def apply_compile(blocks: Iterable[nn.Module]) -> None:
    """Compile each block's forward (after activation checkpointing, so it is traced too)."""
    for block in blocks:
        block.forward = torch.compile(block.forward, fullgraph=True)
