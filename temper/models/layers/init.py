"""Weight initialization shared by the layers."""

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


def trunc_normal_(weight: torch.Tensor, std: float) -> None:
    """Truncated normal cut at 3 std (no outliers at init).

    A sharded weight is drawn as a plain tensor of its full shape and takes its part: one
    process's numbers at any layout, and none of the collectives torch's rejection sampler
    (redraw until nothing is out of range) would run reading the shards whole each pass."""
    sharded = isinstance(weight, DTensor)
    drawn = (
        torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if sharded else weight
    )
    nn.init.trunc_normal_(drawn, std=std, a=-3 * std, b=3 * std)
    if sharded:
        with torch.no_grad():
            weight.copy_(
                distribute_tensor(drawn, weight.device_mesh, weight.placements, src_data_rank=None)
            )


def init_linear(linear: nn.Linear, std: float) -> None:
    """Truncated normal cut at 3 std, zero bias."""
    trunc_normal_(linear.weight, std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


def depth_scaled_std(std: float, n_layers: int) -> float:
    """Std for projections that write into the residual stream (two per block), so its variance
    at init does not grow with depth."""
    return std / math.sqrt(2 * n_layers)
