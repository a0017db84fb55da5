"""One place that applies what a config asks to a decoder, always in the same order."""

from __future__ import annotations

import torch
from torch import nn

from temper.config import Config
from temper.parallel.activation_checkpoint import apply_activation_checkpointing
from temper.parallel.compile import apply_compile
from temper.parallel.context_parallel import ContextParallel
from temper.parallel.dims import Meshes
from temper.parallel.expert import apply_expert_fsdp, apply_expert_parallel
from temper.parallel.fsdp import apply_fsdp, mixed_precision, offload_policy
from temper.parallel.ulysses import SequenceParallel


def parallelize_decoder(
    model: nn.Module, config: Config, meshes: Meshes | None, dtype: torch.dtype
) -> SequenceParallel | ContextParallel | None:
    """Activation checkpointing, then compile, per block; then FSDP2 when `meshes` is given.

    Runs on the meta model, before `materialize`. The order matters: compile traces the
    checkpointed forward, and FSDP wraps the result, keeping its hooks outside the compiled
    region. Expert parallelism comes first (experts sharded by expert over ``ep``), and its
    expert FSDP units wrap before the outer FSDP2, which then skips their parameters.
    Sequence or context parallelism (or both: a `ContextParallel` holding the SP group) comes
    before all of them; its `SequenceParallel` or `ContextParallel` is returned (None without
    either) for the trainer to shard batches with.
    `dtype` bfloat16 makes FSDP gather bf16 weights (fp32 masters, fp32 gradient reduction).
    """
    sequence_parallel: SequenceParallel | ContextParallel | None = None
    cp, sp = (1, 1) if meshes is None else (meshes.world["cp"].size(), meshes.world["sp"].size())
    if cp > 1 and sp > 1:
        world = meshes.world
        sequence_parallel = ContextParallel(
            world["cp"].get_group(), world["sp"].get_group(), world["cp_sp"].get_group()
        )
    elif sp > 1:
        sequence_parallel = SequenceParallel(meshes.world["sp"].get_group())
    elif cp > 1:
        sequence_parallel = ContextParallel(meshes.world["cp"].get_group())
    if sequence_parallel is not None:
        sequence_parallel.apply(model)
    blocks = list(model.layers)
    expert_mesh = meshes.expert if meshes is not None else None
    if expert_mesh is not None:
        apply_expert_parallel(model, expert_mesh)
    apply_activation_checkpointing(blocks, config.activation_checkpoint.mode)
    if config.compile.enable:
        apply_compile(blocks, around_dispatch=expert_mesh is not None, around_ring=cp > 1)
    if meshes is not None:
        offload = offload_policy(config.parallelism.fsdp_cpu_offload, meshes.fsdp.device_type)
        if expert_mesh is not None:
            apply_expert_fsdp(
                model,
                expert_mesh,
                mixed_precision(dtype),
                reshard=config.parallelism.fsdp_reshard_after_forward != "never",
                offload=offload,
            )
        apply_fsdp(
            model,
            meshes.fsdp,
            param_dtype=dtype,
            reshard_after_forward=config.parallelism.fsdp_reshard_after_forward,
            offload=offload,
        )
    return sequence_parallel
