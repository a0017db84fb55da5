"""FSDP2 over a decoder: one unit per block, then embeddings, head and root; gradients summed."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from temper.config import Config, ConfigError, register_rule

ReshardPolicy = Literal["default", "always", "never"]


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reshard_after_forward: ReshardPolicy,
    offload: OffloadPolicy | None = None,
) -> None:
    """Shard `model` (on meta or materialized) over `mesh`: 1-D FSDP or 2-D HSDP.

    Expects the decoder layout ``tok_embeddings, layers, norm, output``. A tied embedding and
    head share one parameter, which FSDP requires to live in one unit: the root. Untied, the
    embedding is its own unit (freed after the first block) and the final norm and head form
    one that stays gathered under every policy: the fused loss reads ``output.weight`` after
    the forward returns, and backward needs it next anyway. Gradients are summed, not
    averaged: the trainer already divides the loss by the global token count.
    """
    mp = mixed_precision(param_dtype)
    blocks = list(model.layers)
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        fully_shard(
            block,
            mesh=mesh,
            mp_policy=mp,
            offload_policy=offload,
            reshard_after_forward=_reshard(reshard_after_forward, needed_next=last),
        )
    if model.output.weight is not model.tok_embeddings.weight:
        fully_shard(
            model.tok_embeddings,
            mesh=mesh,
            mp_policy=mp,
            offload_policy=offload,
            reshard_after_forward=_reshard(reshard_after_forward, needed_next=False),
        )
        fully_shard(
            [model.norm, model.output],
            mesh=mesh,
            mp_policy=mp,
            offload_policy=offload,
            reshard_after_forward=False,
        )
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    # The fused loss calls `hidden_states` instead of forward: FSDP must gather around it too.
    register_fsdp_forward_method(model, "hidden_states")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def mixed_precision(param_dtype: torch.dtype) -> MixedPrecisionPolicy:
    """Compute in `param_dtype` from fp32 master weights; reduce gradients in fp32."""
    if param_dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def offload_policy(cpu_offload: bool, device_type: str) -> OffloadPolicy:
    """``parallelism.fsdp_cpu_offload``'s policy: shards in (pinned, with CUDA) host memory,
    or none."""
    if not cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device_type == "cuda")


def parameter_device(config: Config, device: torch.device) -> torch.device:
    """Where a run's (sharded) parameters are allocated: the host under CPU offload."""
    return torch.device("cpu") if config.parallelism.fsdp_cpu_offload else device


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """Put ``model``'s buffers (RoPE tables) on ``device``: under CPU offload only the
    parameters stay on the host, and the forward reads the buffers where it computes."""
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            setattr(module, name, buffer.to(device))  # stays a buffer, persistent or not


@register_rule
def _check_cpu_offload(config: Config, world_size: int) -> None:
    if config.parallelism.fsdp_cpu_offload and world_size < 2:
        raise ConfigError(
            "parallelism.fsdp_cpu_offload offloads FSDP2's shards; this run has one process "
            "and no FSDP: launch it on several ranks (NGPU=2 ./run_train.sh ...)"
        )


def _reshard(policy: ReshardPolicy, needed_next: bool) -> bool:
    """Free gathered weights after forward? `default`: yes, unless backward needs them next."""
    if policy == "default":
        return not needed_next
    return policy == "always"
