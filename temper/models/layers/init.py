"""Weight initialization shared by the layers."""

import math

from torch import nn


def init_linear(linear: nn.Linear, std: float) -> None:
    """Truncated normal cut at 3 std (no outliers at init), zero bias."""
    nn.init.trunc_normal_(linear.weight, std=std, a=-3 * std, b=3 * std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


def depth_scaled_std(std: float, n_layers: int) -> float:
    """Std for projections that write into the residual stream (two per block), so its variance
    at init does not grow with depth."""
    return std / math.sqrt(2 * n_layers)
