"""Activation checkpointing per decoder block: store less in forward, recompute in backward.

`full` keeps only each block's input; `selective` also keeps the outputs of matmuls, of every
attention backend and of the sequence- and expert-parallel all-to-alls (the expensive ops,
and the ones that talk to other ranks), and recomputes the cheap element-wise rest, so a
backward never runs attention or a collective twice. The block's `forward` is replaced in
place, so parameter names, and thus checkpoints and HF loading, do not change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import temper.kernels.grouped_gemm  # noqa: F401  (registers torch.ops.temper.grouped_mm)
from temper.kernels.attention import ATTENTION_OPS
from temper.models.layers.mlp import keep_products
from temper.utils.compat import sac_ignores_profiler_annotations
from temper.utils.recompute import inside_recomputed_whole

CheckpointMode = Literal["none", "full", "selective"]

_aten = torch.ops.aten
SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten._grouped_mm.default,
    torch.ops.temper.grouped_mm.default,  # the experts' GEMM (and its rows' gradient)
    torch.ops.temper.grouped_mm_weight_grad.default,
    *ATTENTION_OPS,
    # What `all_to_all_single_autograd` and functional `all_to_all_single` (Ulysses, expert
    # dispatch) run; recomputing it would send the same tokens again.
    torch.ops._c10d_functional.all_to_all_single.default,
}


def apply_activation_checkpointing(blocks: Iterable[nn.Module], mode: CheckpointMode) -> None:
    """Checkpoint every block in `mode`; `none` leaves them untouched. The recomputation's
    outputs are dropped, an MoE block's routing statistics among them (`MoE.forward`): the
    forward's are the ones the decoder collected.
    `full` passes no context function at all: torch's default, the one Dynamo traces when a
    block is compiled whole; its feed-forwards keep their SwiGLU product (``keep_products``),
    so the recomputation stops before their down projection."""
    if mode == "none":
        return
    blocks = list(blocks)
    context_fn: Callable[[], Any] | None = None
    if mode == "selective":
        sac_ignores_profiler_annotations()
        context_fn = _selective_contexts
    else:
        keep_products(blocks)
    for block in blocks:
        block.forward = _checkpointed(block.forward, context_fn)


def _checkpointed(
    forward: Callable[..., Any], context_fn: Callable[[], Any] | None
) -> Callable[..., Any]:
    contexts = {} if context_fn is None else {"context_fn": context_fn}

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **contexts, **kwargs)

    return run


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in SAVED_OPS and not inside_recomputed_whole():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_save_matmuls)
