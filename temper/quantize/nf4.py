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
``checkpoint.initial_load``); a checkpoint then holds the NF4 codes and scales, and
``convert`` rebuilds the NF4 layers before loading it, merging into full-precision weights
(``merged_weight`` dequantizes).
"""

from __future__ import annotations

import torch
from torch import nn

from temper.config import Config, ConfigError, register_rule
from temper.models.lora import lora_modules

BLOCK = 64
"""Values per NF4 scale (the QLoRA paper's)."""


def scaler_block(weight: torch.Tensor) -> int | None:
    """Scales per second-level block: the largest of 256, 128, ... that divides the weight's
    count of scales; None when the weight is not a whole number of NF4 blocks."""
    if weight.numel() % BLOCK:
        return None
    scales = weight.numel() // BLOCK
    size = 256
    while size > 1 and scales % size:
        size //= 2
    return size


@torch.no_grad()
def quantize_lora_base(model: nn.Module) -> list[str]:
    """Replace the base weight of every ``LoRALinear`` of ``model`` (materialized, unsharded)
    by its NF4 tensor, frozen; returns the names quantized. A weight that is not a whole
    number of 64-value blocks keeps its dtype."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    names = {id(m): name for name, m in model.named_modules()}
    quantized = []
    for module in lora_modules(model):
        size = scaler_block(module.weight)
        if size is None:
            continue
        weight = to_nf4(module.weight.detach(), BLOCK, size)
        module.weight = nn.Parameter(weight, requires_grad=False)
        quantized.append(names[id(module)])
    return quantized


@register_rule
def _check_qlora(config: Config, world_size: int) -> None:
    if config.lora.quantize_base == "none":
        return
    if not config.lora.enable:
        raise ConfigError(
            f"lora.quantize_base {config.lora.quantize_base} quantizes LoRA's frozen base: add "
            "--lora.enable"
        )
    if world_size > 1:
        raise ConfigError(
            f"lora.quantize_base {config.lora.quantize_base} runs on one process (the NF4 base "
            f"is not sharded by FSDP2 in Temper yet); this run has {world_size}"
        )
