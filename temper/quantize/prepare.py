"""What a config's quantization sections do to the meta model, in one place and one order."""

from __future__ import annotations

from torch import nn

from temper.config import Config, ConfigError
from temper.quantize.float8 import apply_float8
from temper.quantize.float8_experts import apply_float8_experts
from temper.quantize.nf4 import quantize_lora_base
from temper.quantize.qat import prepare_qat


def prepare_model(model: nn.Module, config: Config) -> None:
    """Apply ``quantize.float8`` or ``qat`` to ``model`` (built on meta, LoRA added): before
    parallelization, so FSDP2 shards the swapped layers (and their float8 all-gather)."""
    if config.quantize.float8.enable:
        apply_float8(model, config.quantize.float8)
    if config.quantize.float8.moe_experts and not apply_float8_experts(model):
        raise ConfigError(
            f"quantize.float8.moe_experts: {config.model.hf_path or config.model.name} has no "
            "routed experts with grouped GEMMs (GroupedExperts)"
        )
    if config.qat.enable:
        prepare_qat(model, config.qat)


def finish_model(model: nn.Module, config: Config) -> None:
    """What needs the real weights, once they are in and before the optimizer is built: the
    NF4 base of QLoRA (``lora.quantize_base``)."""
    if config.lora.enable and config.lora.quantize_base == "nf4":
        quantize_lora_base(model)
