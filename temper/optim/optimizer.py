"""Optimizer construction from the config."""

from __future__ import annotations

import torch
from torch import nn

from temper.config import Optimizer as OptimizerConfig
from temper.models.layers.moe import moe_layers
from temper.optim.low_bit import LOW_BIT_ADAMW, build_low_bit_adamw
from temper.optim.muon import Muon
from temper.optim.qk_clip import QKClip


def build_optimizer(model: nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW (``optimizer.name adamw``), torchao's low-bit AdamW (``adamw8bit``, ``adamw4bit``,
    ``adamw_fp8``; same groups) or Muon with AdamW beside it (``muon``)."""
    if config.name == "muon":
        return build_muon(model, config)
    params = [p for p in model.parameters() if p.requires_grad]
    if config.name in LOW_BIT_ADAMW:
        return build_low_bit_adamw(
            config.name,
            _adamw_groups(params, config),
            lr=config.lr,
            betas=(config.beta1, config.beta2),
            eps=config.eps,
        )
    return torch.optim.AdamW(
        _adamw_groups(params, config),
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        fused=True if params and params[0].device.type == "cuda" else None,
    )


def _adamw_groups(params: list[nn.Parameter], config: OptimizerConfig) -> list[dict]:
    """Weight decay on matrices only: decaying norm gains and biases hurts. On CUDA the fused
    kernel updates every parameter in one launch; elsewhere torch's default."""
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def muon_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable matrices Muon steps: the blocks' 2-D weights and stacked experts, less
    MoE routers (a router's rows are per-expert scores, not one linear map to orthogonalize).
    Embeddings, the LM head, norms and biases sit outside this set."""
    routers = {id(p) for m in moe_layers(model.layers).values() for p in m.router.parameters()}
    return [
        p
        for p in model.layers.parameters()
        if p.requires_grad and p.ndim in (2, 3) and id(p) not in routers
    ]


def build_muon(model: nn.Module, config: OptimizerConfig) -> Muon:
    """Muon on `muon_parameters` (its own lr and weight decay), AdamW on the rest. The AdamW
    groups come first, so ``param_groups[0]["lr"]`` (the logged lr) is ``optimizer.lr``'s."""
    matrices = muon_parameters(model)
    chosen = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in chosen]
    adamw = [{**g, "algorithm": "adamw"} for g in _adamw_groups(rest, config)]
    muon = {
        "params": matrices,
        "algorithm": "muon",
        "lr": config.lr if config.muon_lr is None else config.muon_lr,
        "weight_decay": (
            config.weight_decay if config.muon_weight_decay is None else config.muon_weight_decay
        ),
    }
    return Muon(
        adamw + ([muon] if matrices else []),
        lr=config.lr,
        momentum=config.muon_momentum,
        nesterov=config.muon_nesterov,
        ns_steps=config.muon_ns_steps,
        ns_dtype=newton_schulz_dtype(
            config.muon_ns_dtype, matrices[0].device if matrices else torch.device("cpu")
        ),
        scale_rule=config.muon_update_scale,
        update_rms=config.muon_update_rms,
        distribute=config.muon_distribute,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        qk_clip=QKClip(model, config.muon_qk_clip) if config.muon_qk_clip > 0 else None,
    )


def newton_schulz_dtype(choice: str, device: torch.device) -> str:
    """``muon_ns_dtype`` for matrices on ``device``: ``auto`` is bfloat16 where the hardware
    multiplies it (CUDA; a CPU with AVX512-BF16 or AMX) and float32 elsewhere. A CPU without
    them emulates bfloat16 products: llama3_debug's Muon step took 14x as long in bfloat16 as
    in float32 on a 2-core AVX2 host (docs/optimizers.md)."""
    if choice != "auto":
        return choice
    if device.type == "cuda" or (device.type == "cpu" and _cpu_multiplies_bfloat16()):
        return "bfloat16"
    return "float32"


def _cpu_multiplies_bfloat16() -> bool:
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
