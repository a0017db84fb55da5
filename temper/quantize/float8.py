"""FP8 training of the decoder blocks' linear layers with torchao's ``Float8Linear``.

Each chosen ``nn.Linear`` becomes a ``Float8Linear``: its forward casts the input and the
weight to float8 e4m3 with dynamic scales (one per tensor, or one per row with ``rowwise``)
and runs a scaled matmul; backward casts the output gradient to e5m2. The weight stays an
fp32 (or bf16) parameter, so checkpoints, HF export and the optimizer see the model they
always did. The LM head and embeddings (precision-sensitive, vocab-sized), routers and gates
(a few outputs, whose ranking float8 would perturb) and norms keep their dtype; torchao's
scaled matmul needs both dimensions to be multiples of 16, so a layer that is not keeps its
dtype too.

``emulate`` computes the same casts and matmul in plain PyTorch, so every CPU test runs the
math a GPU run does, only slower.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from temper.config import Config, ConfigError, Float8, register_rule
from temper.quantize.targets import block_linears


def float8_targets(model: nn.Module) -> list[str]:
    """The linear layers FP8 trains: ``block_linears`` with both dimensions multiples of 16."""
    return [
        name
        for name, linear in block_linears(model)
        if linear.in_features % 16 == 0 and linear.out_features % 16 == 0
    ]


def apply_float8(model: nn.Module, config: Float8) -> list[str]:
    """Swap ``float8_targets(model)`` (on meta or materialized) for torchao ``Float8Linear``s
    of ``config.recipe``; returns their names."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    fp8 = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(config.recipe),
        emulate=config.emulate,
        enable_fsdp_float8_all_gather=config.fsdp_all_gather,
    )
    names = set(float8_targets(model))
    convert_to_float8_training(model, config=fp8, module_filter_fn=lambda _, fqn: fqn in names)
    return sorted(names)


@register_rule
def _check_float8_experts(config: Config, world_size: int) -> None:
    if not config.quantize.float8.moe_experts:
        return
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        found = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
        raise ConfigError(
            "quantize.float8.moe_experts runs torchao's FP8 grouped GEMM, which needs an NVIDIA "
            f"GPU of compute capability 9.0+ (H100, H200); found {found}. It has no emulation "
            "(quantize.float8.emulate covers the linear layers only)"
        )


@register_rule
def _check_float8(config: Config, world_size: int) -> None:
    float8 = config.quantize.float8
    if not float8.enable:
        return
    if float8.fsdp_all_gather and float8.recipe != "tensorwise":
        raise ConfigError(
            "quantize.float8.fsdp_all_gather works with recipe tensorwise only (torchao "
            f"all-gathers one scale per tensor), got recipe {float8.recipe}"
        )
    if config.lora.enable:
        raise ConfigError(
            "quantize.float8 trains the base linear layers in float8; with lora.enable they "
            "are frozen: use lora.quantize_base nf4 to shrink a frozen base"
        )
    if float8.emulate:
        return
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        found = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
        raise ConfigError(
            f"quantize.float8 needs an NVIDIA GPU with float8 tensor cores (compute capability "
            f"8.9+: H100, H200, L40, RTX 4090); found {found}. Add "
            "--quantize.float8.emulate to run the same math in plain PyTorch (tests, debugging)"
        )
