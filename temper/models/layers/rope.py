"""Rotary position embeddings in the rotate-half layout used by HF checkpoints.

The frequencies pair dimension ``i`` with ``i + head_dim // 2`` (``cat(freqs, freqs)``), so HF
q/k projection weights load without the permutation that Meta's interleaved layout needs.
"""

import math
from dataclasses import dataclass

import torch


@dataclass
class RopeScaling:
    """Llama 3.1 frequency scaling: long wavelengths are stretched by ``factor``, short kept."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, numerically equal to transformers' Llama 3 init.

    Wavelengths shorter than ``original / high_freq_factor`` are kept, those longer than
    ``original / low_freq_factor`` are divided by ``factor``, and the band between is a linear
    blend of the two in ``original / wavelength``.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is None:
        return inv_freq
    s = scaling
    wavelen = 2 * math.pi / inv_freq
    blend = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - blend) * inv_freq / s.factor + blend * inv_freq
    is_long = wavelen > s.original_max_position_embeddings / s.low_freq_factor
    is_short = wavelen < s.original_max_position_embeddings / s.high_freq_factor
    return torch.where(is_short, inv_freq, torch.where(is_long, inv_freq / s.factor, smoothed))


def rope_cos_sin(
    inv_freq: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [batch, seq, head_dim] in fp32 for integer positions [batch, seq]."""
    freqs = position_ids[..., None].float() * inv_freq.float()
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, seq, heads, head_dim]; cos/sin are cast to x's dtype first, as HF does."""
    cos = cos.to(x.dtype).unsqueeze(2)
    sin = sin.to(x.dtype).unsqueeze(2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
