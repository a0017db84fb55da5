"""One place that applies what a config asks to a decoder, always in the same order."""

from __future__ import annotations

import torch
from torch import nn

from temper.config import Config
from temper.parallel.activation_checkpoint import apply_activation_checkpointing
from temper.parallel.compile import apply_compile
from temper.parallel.dims import Meshes
from temper.parallel.fsdp import apply_fsdp


def parallelize_decoder(
    model: nn.Module, config: Config, meshes: Meshes | None, dtype: torch.dtype
) -> None:
    """Activation checkpointing, then compile, per block; then FSDP2 when `meshes` is given.

    Runs on the meta model, before `materialize`. The order matters: compile traces the
    checkpointed forward, and FSDP wraps the result, keeping its hooks outside the compiled
    region. Sequence parallelism and expert parallelism will come first, before checkpointing.
    `dtype` bfloat16 makes FSDP gather bf16 weights (fp32 masters, fp32 gradient reduction).
    """
    blocks = list(model.layers)
    apply_activation_checkpointing(blocks, config.activation_checkpoint.mode)
    if config.compile.enable:
        apply_compile(blocks)
    if meshes is not None:
        apply_fsdp(
            model,
            meshes.fsdp,
            param_dtype=dtype,
            reshard_after_forward=config.parallelism.fsdp_reshard_after_forward,
        )
