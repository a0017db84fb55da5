"""QLoRA: the frozen base weights of LoRA's layers stored in 4-bit NormalFloat (torchao).

Dettmers et al. (2023) store a frozen base in NF4: 4-bit codes that are the quantiles of a
normal distribution, one absmax scale per block of 64 values, the scales themselves
quantized to 8 bits in blocks of up to 256 ("double quantization"): about 0.52 bytes a value,
where fp32 takes 4 and bf16 2. The forward dequantizes a whole weight to its original dtype
and runs the ordinary matmul; the adapters (full precision) train as in LoRA, and no gradient
reaches the base. Dequantizing is exact arithmetic on the stored codes, so the QLoRA forward
is the forward of the dequantized base plus the adapters; the quantization error is the base
weight's alone.

The base is quantized after the weights are in (random init, ``model.hf_path``,
``checkpoint.initial_load``), under FSDP2 on the full weight and then split by rows, so each
rank holds its share of the NF4 bytes and the gathered base is one process's; a checkpoint
then holds the NF4 codes and scales, and
``convert`` rebuilds the NF4 layers before loading it, merging into full-precision weights
(``merged_weight`` dequantizes).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.tensor import DTensor, Shard

from temper.config import Config, ConfigError, register_rule
from temper.models.lora import lora_modules
from temper.utils.compat import replace_fsdp_sharded_param

BLOCK = 64
"""Values per NF4 scale (the QLoRA paper's)."""


def scaler_block(weight: torch.Tensor, shards: int = 1) -> int | None:
    """Scales per second-level block: the largest of 256, 128, ... whose blocks split evenly
    into ``shards`` row shards (FSDP2's); None when the weight is not a whole number of NF4
    blocks, or its rows or blocks do not split into ``shards``."""
    if weight.numel() % BLOCK or weight.shape[0] % shards:
        return None
    scales = weight.numel() // BLOCK
    size = 256
    while size > 1 and scales % (size * shards):
        size //= 2
    return size if scales % (size * shards) == 0 else None


@torch.no_grad()
def quantize_lora_base(model: nn.Module, shards: int = 1) -> list[str]:
    """Replace the base weight of every ``LoRALinear`` of ``model`` (materialized) by its NF4
    tensor, frozen; returns the names quantized. A weight that is not a whole number of
    64-value blocks (per shard) keeps its dtype. ``shards``: quantize an unsharded model as a
    run sharded that many ways did (the blocks it picked), to load that run's checkpoint.

    An FSDP2-sharded weight is gathered, quantized whole (the NF4 of one process, scales and
    their mean from the full tensor) and split by rows: each rank keeps its rows' codes and
    scales, and FSDP2 all-gathers those (torchao's NF4 all-gather extension) for the forward.
    """
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    names = {id(m): name for name, m in model.named_modules()}
    quantized = []
    for module in lora_modules(model):
        weight = module.weight.detach()
        sharded = isinstance(weight, DTensor)
        size = scaler_block(weight, weight.device_mesh.size() if sharded else shards)
        if size is None:
            continue
        if not sharded:
            module.weight = nn.Parameter(to_nf4(weight, BLOCK, size), requires_grad=False)
        else:
            if weight.device_mesh.ndim != 1 or weight.placements != (Shard(0),):
                raise ValueError(
                    f"lora.quantize_base nf4: {names[id(module)]} is laid out as "
                    f"{weight.placements}; NF4 shards only over one FSDP2 dim"
                )
            rows = torch.chunk(to_nf4(weight.full_tensor(), BLOCK, size), weight.device_mesh.size())
            local = rows[weight.device_mesh.get_local_rank()]
            param = DTensor.from_local(
                local,
                weight.device_mesh,
                weight.placements,
                run_check=False,
                shape=weight.shape,
                stride=weight.stride(),
            )
            replace_fsdp_sharded_param(
                model, module, "weight", nn.Parameter(param, requires_grad=False)
            )
        quantized.append(names[id(module)])
    return quantized


class RowShardedNF4Planner(DefaultLoadPlanner):
    """Loads NF4 bases saved as FSDP2 row shards into whole NF4 tensors (quantized with the
    same blocks, ``quantize_lora_base(model, shards)``): a saved shard's codes and scales are
    copied into the matching rows of the whole tensor's, which NF4 splits as views. DCP would
    slice the whole NF4 tensor instead, which NF4 does not implement."""

    def transform_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

        rows = read_item.lengths[0]
        if isinstance(tensor, NF4Tensor) and rows < tensor.shape[0]:
            return torch.chunk(tensor, tensor.shape[0] // rows)[read_item.dest_offsets[0] // rows]
        return super().transform_tensor(read_item, tensor)


@register_rule
def _check_qlora(config: Config, world_size: int) -> None:
    if config.lora.quantize_base == "none":
        return
    if not config.lora.enable:
        raise ConfigError(
            f"lora.quantize_base {config.lora.quantize_base} quantizes LoRA's frozen base: add "
            "--lora.enable"
        )
    if world_size == 1:
        return
    parallelism = config.parallelism
    others = {
        "parallelism.dp_replicate": parallelism.dp_replicate,
        "parallelism.sp": parallelism.sp,
        "parallelism.ep": parallelism.ep,
    }
    for flag, degree in others.items():
        if degree != 1:
            raise ConfigError(
                f"lora.quantize_base {config.lora.quantize_base} shards the NF4 base with FSDP2 "
                f"alone (parallelism.dp_shard); {flag} {degree} is not supported with it"
            )
    if parallelism.fsdp_cpu_offload:
        raise ConfigError(
            f"lora.quantize_base {config.lora.quantize_base} with parallelism.fsdp_cpu_offload "
            "is not supported (the NF4 shards are not offloaded)"
        )
