"""Quantization-aware fine-tuning with torchao's QAT, and the real quantization after it.

``prepare_qat`` swaps the blocks' linear layers for torchao ``FakeQuantizedLinear``s: each
forward rounds the weight to ``weight_bits`` integers with one symmetric scale per group of
``group_size`` inputs (and, with ``activations``, the input to int8 with one scale per
token), then computes in floating point; backward passes the gradient straight through the
rounding. The weights stay ordinary parameters (checkpoints and HF export are unchanged), but
training has learnt weights that survive rounding.

``quantize_for_inference`` makes the quantization real: the same layers get torchao's
``IntxUnpackedToInt8Tensor`` weights (integer codes and per-group scales; the matmul
dequantizes or, on CPUs with torchao's kernels, runs on the codes), from the numbers the fake
quantizer used. Applied to a model that was trained without QAT it is post-training
quantization (PTQ), the comparison QAT has to beat. ``load_quantized`` reads an exported HF
folder (full-precision weights, as transformers loads them) and quantizes it so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from temper.config import QAT, Config, ConfigError, register_rule
from temper.quantize.targets import block_linears

QUANTIZATION_FILE = "temper_quantization.json"
"""Written beside an exported QAT model's config.json: the scheme ``load_quantized`` applies."""


def qat_targets(model: nn.Module, qat: QAT) -> list[str]:
    """``block_linears`` whose input width is a whole number of groups."""
    linears = block_linears(model)
    return [name for name, linear in linears if linear.in_features % qat.group_size == 0]


def base_config(qat: QAT) -> Any:
    """torchao's (post-training) quantization config that ``qat`` trains for."""
    from torchao.quantization import (
        Int8DynamicActivationIntxWeightConfig,
        IntxWeightOnlyConfig,
    )
    from torchao.quantization.granularity import PerGroup

    weight_dtype = {4: torch.int4, 8: torch.int8}[qat.weight_bits]
    if qat.activations:
        return Int8DynamicActivationIntxWeightConfig(
            weight_dtype=weight_dtype, weight_granularity=PerGroup(qat.group_size)
        )
    return IntxWeightOnlyConfig(weight_dtype=weight_dtype, granularity=PerGroup(qat.group_size))


def prepare_qat(model: nn.Module, qat: QAT) -> list[str]:
    """Swap ``qat_targets(model)`` (on meta or materialized) for fake-quantized layers."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    names = set(qat_targets(model, qat))
    quantize_(model, QATConfig(base_config(qat), step="prepare"), filter_fn=_named(names))
    return sorted(names)


@torch.no_grad()
def quantize_for_inference(model: nn.Module, qat: QAT) -> nn.Module:
    """Give ``qat_targets``' layers real quantized weights, in place: the fake-quantized layers
    of a QAT model (converted back to ``nn.Linear`` first) or a plain model's (PTQ)."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import FakeQuantizedLinear, QATConfig

    fake = {name for name, m in model.named_modules() if isinstance(m, FakeQuantizedLinear)}
    if fake:
        quantize_(model, QATConfig(base_config(qat), step="convert"), filter_fn=_named(fake))
    else:
        names = set(qat_targets(model, qat))
        quantize_(model, base_config(qat), filter_fn=_named(names))
    return model


def write_quantization(folder: str | os.PathLike[str], qat: dict[str, Any]) -> None:
    """Record ``qat`` (a QAT section as a dict) in an exported folder."""
    (Path(folder) / QUANTIZATION_FILE).write_text(json.dumps(qat, indent=2) + "\n")


def load_quantized(folder: str | os.PathLike[str], device: str = "cpu") -> nn.Module:
    """An exported QAT folder as the quantized model it was trained for: its full-precision
    weights (``temper.models.load_hf``) quantized by the scheme its temper_quantization.json
    records."""
    from temper.models import load_hf

    path = Path(folder) / QUANTIZATION_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no {QUANTIZATION_FILE}; was it exported from QAT?")
    qat = QAT(**json.loads(path.read_text()))
    model = load_hf(folder, dtype=torch.float32, device=device)
    return quantize_for_inference(model, qat).eval()


def _named(names: set[str]) -> Any:
    return lambda _, fqn: fqn in names


@register_rule
def _check_qat(config: Config, world_size: int) -> None:
    qat = config.qat
    if not qat.enable:
        return
    if qat.group_size <= 0:
        raise ConfigError(f"qat.group_size must be > 0, got {qat.group_size}")
    if config.quantize.float8.enable:
        raise ConfigError("qat.enable and quantize.float8.enable both rewrite the linear layers")
    if config.lora.enable:
        raise ConfigError(
            "qat.enable fake-quantizes the weights it trains; with lora.enable they are frozen"
        )
