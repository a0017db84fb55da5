"""Several linear layers that read the same input, as one matrix product."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def fused_linears(x: torch.Tensor, layers: Sequence[nn.Linear]) -> list[torch.Tensor]:
    """Each layer's output on ``x``. Where every layer is a plain bias-free ``nn.Linear``,
    one product on their stacked weights, split: one larger GEMM is faster than several
    narrow ones (on CPU, Gated DeltaNet's four input projections at [4096, 512] took a
    quarter less time fused, forward and backward), and the stacked weight is a copy of a
    few MiB. Any other layer (LoRA, float8, fake-quantized, NF4) runs its own forward."""
    if not all(type(layer) is nn.Linear and layer.bias is None for layer in layers):
        return [layer(x) for layer in layers]
    weight = torch.cat([layer.weight for layer in layers])
    return list(F.linear(x, weight).split([layer.out_features for layer in layers], dim=-1))
