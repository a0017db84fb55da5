"""Regional compilation: `torch.compile` each decoder block, not the whole model.

Blocks share one code path, so one compiled graph serves them all and compile time does
not grow with depth; FSDP's hooks stay outside the compiled region. As with activation
checkpointing, `forward` is replaced in place and parameter names do not change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from temper.utils.compat import forward_side_effects_once


def apply_compile(
    blocks: Iterable[nn.Module], backend: str = "inductor", fullgraph: bool = True
) -> None:
    """Compile each block's forward (after activation checkpointing, so it is traced too).
    A checkpointed MoE block records its routing statistics in forward, a side effect that
    torch.compile refuses inside a checkpoint unless told not to replay it in backward,
    which is what eager does too (`keep_first_routing`). ``fullgraph=False`` lets a block
    run a part eagerly between compiled ones: expert parallelism's all-to-all dispatch."""
    for block in blocks:
        block.forward = _keeping_forward_side_effects(
            torch.compile(block.forward, fullgraph=fullgraph, backend=backend)
        )


def _keeping_forward_side_effects(compiled: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(compiled)
    def run(*args: Any, **kwargs: Any) -> Any:
        with forward_side_effects_once():
            return compiled(*args, **kwargs)

    return run
