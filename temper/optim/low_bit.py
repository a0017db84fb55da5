"""AdamW with its moments stored in 8, 4 or fp8 bits (torchao.optim), the update computed
in fp32.

AdamW's state is two fp32 moments per parameter (8 bytes). torchao's low-bit AdamWs keep each
moment as a tensor subclass of blocks of codes with one fp32 scale per block (256 values, 128
for 4-bit): about 2 bytes a parameter for 8-bit, 1 for 4-bit, 2 for fp8. The step dequantizes
a block, updates it in fp32 and quantizes it back, in one ``torch.compile``d function per
parameter shape (on CPU too: the first step compiles). The states are DTensor-aware (FSDP2)
and save to DCP as ordinary tensors of their codes and scales.

torchao is imported only when one of these is asked for.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

LOW_BIT_ADAMW = {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit", "adamw_fp8": "AdamWFp8"}
"""``optimizer.name`` -> the torchao.optim class."""


def build_low_bit_adamw(
    name: str,
    groups: Iterable[dict[str, Any]],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
) -> torch.optim.Optimizer:
    """torchao's AdamW of ``name`` (a key of ``LOW_BIT_ADAMW``) on ``groups``. Parameters
    smaller than a quantization block (norm gains, biases) keep plain fp32 moments: torchao
    quantizes only tensors of at least 4096 values."""
    import torchao.optim

    optimizer_class = getattr(torchao.optim, LOW_BIT_ADAMW[name])
    return optimizer_class(list(groups), lr=lr, betas=betas, eps=eps)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes the optimizer's state tensors hold (codes and scales of a quantized moment), on
    this rank: what a low-bit optimizer saves against AdamW's fp32 moments."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += tensor_bytes(value)
    return total


def tensor_bytes(value: torch.Tensor) -> int:
    """Storage bytes of ``value``: a plain tensor's own, or a tensor subclass's inner
    tensors' (a quantized moment's codes and scales); a DTensor counts its local shard."""
    if isinstance(value, DTensor):
        value = value.to_local()
    if type(value) in (torch.Tensor, torch.nn.Parameter):
        return value.numel() * value.element_size()
    names, _ = value.__tensor_flatten__()
    return sum(tensor_bytes(getattr(value, name)) for name in names)
