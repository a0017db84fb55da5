"""Grouped linear: one independent projection per group of input features, DeepSeek V4's
grouped output projection.

V4's attention output is ``n_heads * head_dim`` wide (32768 in Flash). Instead of one dense map
to ``dim``, the heads are split into ``g`` groups, each group projected on its own to a narrow
``d_g`` (a block-diagonal matrix, ``o_a``), and the ``g * d_g`` results mixed to ``dim`` by an
ordinary linear (``o_b``).
"""

from __future__ import annotations

import torch
from torch import nn

from temper.models.layers.init import trunc_normal_


class GroupedLinear(nn.Module):
    """``n_groups`` maps of ``in_features`` -> ``out_features // n_groups``, stored as one
    ``weight`` [out_features, in_features] (group after group, nn.Linear's layout, as HF
    checkpoints hold it)."""

    def __init__(self, in_features: int, out_features: int, n_groups: int) -> None:
        super().__init__()
        if out_features % n_groups:
            raise ValueError(f"out_features {out_features} is not divisible by {n_groups} groups")
        self.n_groups = n_groups
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def init_weights(self, std: float) -> None:
        trunc_normal_(self.weight, std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n_groups, in_features] -> [..., n_groups, out_features // n_groups]."""
        w = self.weight.view(self.n_groups, -1, self.weight.shape[-1])
        return torch.einsum("...gi,goi->...go", x, w)
