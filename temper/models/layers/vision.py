"""The Qwen3-VL-family vision tower (Qwen3.5's): patches in, language-model-wide features out.

An image arrives as ``pixel_values`` [patches, C * T * P * P] (the image processor's
flattened patches, T frames of P x P pixels per patch) with its grid ``(t, h, w)`` in
patches; the processor orders each image's patches in merge blocks (each group of
``merge * merge`` neighbours adjacent), which the merger relies on. Per patch: a linear map
(the 3-D convolution whose stride equals its kernel), plus a learned position table resampled
bilinearly to the image's grid; then ViT blocks that attend within each frame, with 2-D
rotary angles from the patch's (row, column); then the merger concatenates each merge
block's patches and maps them into the language model's width: one token per block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from temper.kernels.dispatch import Kernels
from temper.models.layers.init import trunc_normal_
from temper.models.layers.rope import apply_rope

ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}
"""HF ``hidden_act`` names of the tower MLP -> ``F.gelu``'s ``approximate``."""


@dataclass(kw_only=True)
class VisionArgs:
    """Shapes of the tower; ``out_dim`` is the language model's width."""

    dim: int
    n_layers: int
    n_heads: int
    ffn_hidden_dim: int
    out_dim: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    n_position_embeddings: int = 2304
    """Entries of the learned position table, a square grid."""
    rope_theta: float = 10000.0
    activation: str = "gelu_pytorch_tanh"
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 4:
            raise ValueError(
                f"vision dim {self.dim} over n_heads {self.n_heads} must give a head_dim "
                "divisible by 4 (rotary halves split between rows and columns)"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"vision activation {self.activation!r} is not supported: {sorted(ACTIVATIONS)}"
            )
        side = int(self.n_position_embeddings**0.5)
        if side * side != self.n_position_embeddings:
            raise ValueError(f"n_position_embeddings {self.n_position_embeddings} is not square")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merged_dim(self) -> int:
        return self.dim * self.spatial_merge_size**2


class VisionAttention(nn.Module):
    """Bidirectional attention within each frame of each image (``frames``: their lengths)."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        frames: list[int],
        kernels: Kernels,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.n_heads, -1).unbind(1)
        # Rotary in fp32, as the reference does, then back to the activations' dtype; with the
        # run's rotary kernel, as the decoder's attention has.
        q, k = (
            apply_rope(t[None].float(), cos, sin, impl=kernels.rope)[0].to(x.dtype) for t in (q, k)
        )
        out = [
            F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in qkv))[0]
            for qkv in zip(*(t.split(frames) for t in (q, k, v)), strict=True)
        ]
        return self.proj(torch.cat(out, dim=1).transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, activation: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden_dim)
        self.linear_fc2 = nn.Linear(hidden_dim, dim)
        self.approximate = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    """Pre-LayerNorm ViT block."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attn = VisionAttention(args.dim, args.n_heads)
        self.norm2 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.mlp = VisionMLP(args.dim, args.ffn_hidden_dim, args.activation)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        frames: list[int],
        kernels: Kernels,
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frames, kernels)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm per patch, then each merge block's patches side by side through a GELU MLP
    into the language model's width."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.merged_dim = args.merged_dim
        self.norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.linear_fc1 = nn.Linear(args.merged_dim, args.merged_dim)
        self.linear_fc2 = nn.Linear(args.merged_dim, args.out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.merged_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    """``forward(pixel_values, grid_thw, kernels)`` -> features [sum(t * h * w) / merge^2,
    out_dim], one row per image token, images in order; ``kernels``: the fused ops' choices
    (the language model's own, ``use_kernels``)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        # The 3-D convolution's kernel, kept in its HF shape [dim, C, T, P, P]: with stride equal
        # to its kernel it is a linear map of each flattened patch.
        kernel = (args.in_channels, args.temporal_patch_size, args.patch_size, args.patch_size)
        self.patch_embed = nn.ParameterDict(
            {
                "weight": nn.Parameter(torch.empty(args.dim, *kernel)),
                "bias": nn.Parameter(torch.empty(args.dim)),
            }
        )
        self.pos_embed = nn.Embedding(args.n_position_embeddings, args.dim)
        self.blocks = nn.ModuleList(VisionBlock(args) for _ in range(args.n_layers))
        self.merger = PatchMerger(args)
        self.register_buffer("inv_freq", self.rope_inv_freq(), persistent=False)

    def rope_inv_freq(self) -> torch.Tensor:
        """head_dim / 4 frequencies, shared by the row and the column axis."""
        quarter = self.args.head_dim // 2
        exponents = torch.arange(0, quarter, 2, dtype=torch.float32) / quarter
        return 1.0 / self.args.rope_theta**exponents

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, kernels: Kernels
    ) -> torch.Tensor:
        grids = [tuple(g) for g in grid_thw.tolist()]
        weight = self.patch_embed["weight"]
        x = F.linear(pixel_values.to(weight.dtype), weight.flatten(1), self.patch_embed["bias"])
        x = x + self.grid_position_embeddings(grids).to(x.dtype)
        cos, sin = self.rope(grids)
        frames = [h * w for t, h, w in grids for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, frames, kernels)
        return self.merger(x)

    def merge_block_order(self, h: int, w: int) -> torch.Tensor:
        """Raster indices of an h x w grid's patches in the processor's merge-block order."""
        m = self.args.spatial_merge_size
        raster = torch.arange(h * w, device=self.inv_freq.device).view(h // m, m, w // m, m)
        return raster.transpose(1, 2).flatten()

    def grid_position_embeddings(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The square learned table resampled (bilinear, corners aligned) to each grid, in
        merge-block order, repeated over the frames."""
        side = int(self.args.n_position_embeddings**0.5)
        table = self.pos_embed.weight.view(side, side, -1).permute(2, 0, 1)[None]
        parts = []
        for t, h, w in grids:
            grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)
            grid = grid[0].flatten(1).t()[self.merge_block_order(h, w)]
            parts.append(grid.repeat(t, 1))
        return torch.cat(parts)

    def rope(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [1, patches, head_dim]: the first half of the rotated pairs turns with
        the patch's row, the second with its column."""
        positions = []
        for t, h, w in grids:
            order = self.merge_block_order(h, w)
            rows_cols = torch.stack((order // w, order % w), dim=-1)
            positions.append(rows_cols.repeat(t, 1))
        freqs = torch.cat(positions)[..., None].float() * self.inv_freq  # [n, 2, head_dim / 4]
        angles = freqs.flatten(1)
        angles = torch.cat((angles, angles), dim=-1)[None]
        return angles.cos(), angles.sin()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Fresh weights from the current torch RNG (after ``to_empty``)."""
        self.inv_freq.copy_(self.rope_inv_freq())
        for module in self.modules():
            if isinstance(module, nn.Linear):
                trunc_normal_(module.weight, std)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        trunc_normal_(self.patch_embed["weight"], std)
        nn.init.zeros_(self.patch_embed["bias"])
        nn.init.normal_(self.pos_embed.weight, std=std)
