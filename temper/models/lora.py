"""LoRA: low-rank adapters on chosen linear layers, the base weights frozen.

``apply_lora`` runs on the meta model before parallelization, so FSDP2 shards the adapters
with their block; ``init_lora`` fills them after ``materialize`` (A as ``nn.Linear``'s
default init, B zero, so the adapted model starts equal to the base). A ``LoRALinear`` is an
``nn.Linear`` with extra parameters: the base weight keeps its name, so HF loading is
unchanged, and ``merge_lora`` folds the adapters back into plain ``nn.Linear`` weights for
export. ``adapters_disabled`` gives the base model, the DPO reference when LoRA is on.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import re
import sys
from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from temper.config import DEFAULT_LORA_TARGETS


class LoRALinear(nn.Linear):
    """``x W^T + b + scale * dropout(x) A^T B^T``, with ``A`` [rank, in] and ``B`` [out, rank]."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        *,
        rank: int,
        alpha: float,
        dropout: float,
        rslora: bool,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.lora_a = nn.Parameter(torch.empty(rank, in_features))
        self.lora_b = nn.Parameter(torch.empty(out_features, rank))
        self.dropout = nn.Dropout(dropout)
        # rsLoRA (Kalajdzievski, 2023): alpha / sqrt(rank) keeps the update's scale
        # independent of the rank, where alpha / rank shrinks it as the rank grows.
        self.scale = alpha / math.sqrt(rank) if rslora else alpha / rank
        self.enabled = True

    def reset_lora(self) -> None:
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.enabled:
            return out
        return out + self.scale * F.linear(F.linear(self.dropout(x), self.lora_a), self.lora_b)


ALL_LINEAR = "all-linear"
"""PEFT's shorthand: every linear layer but the output head."""


def lora_targets(
    model: nn.Module, patterns: Sequence[str], hf_names: Mapping[str, str] | None = None
) -> list[str]:
    """The linear layers that ``patterns`` name: fnmatch patterns on Temper's module names
    (``layers.*.attention.wq``), Hugging Face module names as PEFT reads them (``q_proj``
    matches every ``...q_proj``; ``hf_names`` maps native to HF names), or ``all-linear``.
    A pattern that matches nothing fails, listing the names there are (a built-in default
    only when nothing at all matches)."""
    hf_names = hf_names or {}
    linear = [name for name, module in model.named_modules() if type(module) is nn.Linear]

    def matches(name: str, pattern: str) -> bool:
        if pattern == ALL_LINEAR:
            return name != "output"
        hf = hf_names.get(name)
        return fnmatch.fnmatchcase(name, pattern) or (
            hf is not None
            and (fnmatch.fnmatchcase(hf, pattern) or fnmatch.fnmatchcase(hf, f"*.{pattern}"))
        )

    chosen = [name for name in linear if any(matches(name, p) for p in patterns)]
    for pattern in patterns:
        if pattern in DEFAULT_LORA_TARGETS and chosen:
            continue  # a default that this family lacks (see DEFAULT_LORA_TARGETS)
        if not any(matches(name, pattern) for name in linear):
            native = sorted({re.sub(r"\.\d+\.", ".*.", name) for name in linear})
            hf = sorted({hf_names[n].rpartition(".")[2] for n in linear if n in hf_names})
            raise ValueError(
                f"lora.target_modules {pattern!r} matches no linear layer of "
                f"{type(model).__name__}; Hugging Face names: {', '.join(hf) or 'none'}; "
                f"Temper names: {', '.join(native)}; or {ALL_LINEAR}"
            )
    return chosen


def apply_lora(
    model: nn.Module,
    target_modules: Sequence[str],
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    rslora: bool = False,
    hf_names: Mapping[str, str] | None = None,
) -> list[str]:
    """Swap every ``nn.Linear`` that ``target_modules`` name (see ``lora_targets``) for a
    ``LoRALinear`` and freeze all other parameters; returns the adapted names."""
    names = lora_targets(model, target_modules, hf_names)
    for param in model.parameters():
        param.requires_grad_(False)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        base = getattr(parent, child)
        with torch.device(base.weight.device):
            lora = LoRALinear(
                base.in_features,
                base.out_features,
                base.bias is not None,
                rank=rank,
                alpha=alpha,
                dropout=dropout,
                rslora=rslora,
            )
        lora.weight = base.weight
        lora.bias = base.bias
        setattr(parent, child, lora)
    return names


def lora_modules(model: nn.Module) -> Iterator[LoRALinear]:
    return (m for m in model.modules() if isinstance(m, LoRALinear))


def init_lora(model: nn.Module) -> None:
    """Fill the adapters after ``materialize`` (which re-inits only the base weights)."""
    with torch.no_grad():
        for module in lora_modules(model):
            module.reset_lora()


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model inside the block: every adapter off, then back on."""
    modules = list(lora_modules(model))
    for module in modules:
        module.enabled = False
    try:
        yield
    finally:
        for module in modules:
            module.enabled = True


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Replace each (unsharded) ``LoRALinear`` by an ``nn.Linear`` holding W + scale * B A."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, LoRALinear):
            continue
        merged = nn.Linear(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            device=module.weight.device,
            dtype=module.weight.dtype,
        )
        merged.weight.copy_(merged_weight(module.weight, module))
        if module.bias is not None:
            merged.bias.copy_(module.bias)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, merged)
    return model


def merged_weight(weight: torch.Tensor, module: LoRALinear) -> torch.Tensor:
    """``W + scale * B A`` (computed in fp32) from the full base ``weight`` and ``module``'s
    adapters, gathered here when sharded. A quantized base (QLoRA's NF4) dequantizes in
    ``.to(float32)``, and the merged weight has the dtype it was quantized from."""
    a, b = (full_tensor(p.detach()) for p in (module.lora_a, module.lora_b))
    return merge_adapters(weight, a, b, module.scale)


def merge_adapters(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float
) -> torch.Tensor:
    """``W + scale * B A``, computed in fp32, in ``W``'s dtype (a quantized base, QLoRA's
    NF4, dequantizes in ``.to(float32)``; the merge has the dtype it was quantized from)."""
    base = weight.to(torch.float32)
    return (base + scale * (lora_b.float() @ lora_a.float())).to(weight.dtype)


NF4_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"
"""Where QLoRA's NF4 tensor lives; no NF4 tensor exists until it is imported."""


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (a collective), or the tensor itself.

    A row-sharded NF4 base (QLoRA under FSDP2) comes back dequantized: each rank dequantizes
    its rows (whole NF4 blocks, so exactly the full tensor's rows) and the dense rows are
    gathered. Gathering the NF4 shard itself (torchao's all-gather of its inner tensors under
    ``DTensor.full_tensor``) corrupts the heap on gloo: a rank aborts with "malloc():
    unaligned tcache chunk detected" and its peers see "connection reset by peer"."""
    if not isinstance(value, DTensor):
        return value
    nf4 = sys.modules.get(NF4_MODULE)
    local = value.to_local()
    if nf4 is not None and isinstance(local, nf4.NF4Tensor):
        value = DTensor.from_local(
            local.get_original_weight(),
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    return value.full_tensor()
