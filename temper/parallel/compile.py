"""Regional compilation: `torch.compile` each decoder block, not the whole model.

Blocks share one code path, so one compiled graph serves them all and compile time does
not grow with depth; FSDP's hooks stay outside the compiled region. As with activation
checkpointing, `forward` is replaced in place and parameter names do not change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from temper.models.layers.context import SequenceMixer
from temper.models.layers.moe import moe_layers
from temper.utils.recompute import recomputed_whole


def apply_compile(
    blocks: Iterable[nn.Module],
    backend: str = "inductor",
    around_dispatch: bool = False,
    around_ring: bool = False,
) -> None:
    """Compile each block's forward (after activation checkpointing, so it is traced too).
    A block returns its routing statistics and its sparse-attention indexer's KL beside its
    output (`BlockAux`), so it has no side effect to trace.

    ``around_dispatch`` (expert parallelism, whose all-to-all dispatch reads its split sizes
    on the host and cannot be traced) compiles each block's parts instead: every module but
    the MoE layer, and the MoE layer's router, shared expert and its gate. The block's code, the
    MoE layer's and the dispatch run eagerly, so its checkpoint is an eager one: its forward
    and its recomputation run the same compiled parts, which selective checkpointing needs
    to match one to the other (a block compiled around a graph break would be recomputed
    without them). Selective checkpointing keeps what runs between the parts; each part is
    recomputed whole (`recomputed_whole`).

    ``around_ring`` (context parallelism, whose ring passes K/V blocks or states with
    point-to-point sends that cannot be traced) compiles parts the same way, the token mixer
    left eager around its ring and its projections and norms compiled one by one."""
    for block in blocks:
        if around_dispatch or around_ring:
            for part in _parts_around(block, around_dispatch, around_ring):
                compiled = torch.compile(part.forward, fullgraph=True, backend=backend)
                part.forward = _inside(recomputed_whole, compiled)
        else:
            block.forward = torch.compile(block.forward, fullgraph=True, backend=backend)


def _parts_around(block: nn.Module, dispatch: bool, ring: bool) -> Iterator[nn.Module]:
    moes = moe_layers(block) if dispatch else {}
    for name, child in block.named_children():
        if name in moes:
            yield from (p for n, p in child.named_children() if n != "experts")
        elif ring and isinstance(child, SequenceMixer):
            yield from child.children()
        else:
            yield child


def _inside(
    context: Callable[[], AbstractContextManager[Any]], compiled: Callable[..., Any]
) -> Callable[..., Any]:
    """``compiled``, each call run inside a fresh ``context()``."""

    @functools.wraps(compiled)
    def run(*args: Any, **kwargs: Any) -> Any:
        with context():
            return compiled(*args, **kwargs)

    return run
