"""Rotary position embeddings in the rotate-half layout used by HF checkpoints.

The frequencies pair dimension ``i`` with ``i + head_dim // 2`` (``cat(freqs, freqs)``), so HF
q/k projection weights load without the permutation that Meta's interleaved layout needs.
DeepSeek checkpoints keep the interleaved layout; ``apply_rope(..., interleaved=True)`` reads it.
"""

import math
from dataclasses import dataclass

import torch

from temper.kernels.dispatch import Impl
from temper.kernels.rope import apply_rope as rotate


@dataclass
class RopeScaling:
    """Llama 3.1 frequency scaling: long wavelengths are stretched by ``factor``, short kept."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class YarnScaling:
    """YaRN context extension (DeepSeek V3): high frequencies kept, low ones divided by ``factor``,
    a linear ramp between; and a magnitude correction for the longer context (``mscale``).

    ``mscale``, ``mscale_all_dim`` and ``attention_factor`` are optional as in HF configs: None
    (or 0, as transformers reads them) means absent.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    """Dims rotating more than this many times over the original context keep their frequency."""
    beta_slow: float = 1.0
    """Dims rotating fewer times than this are fully interpolated (divided by ``factor``)."""
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    """Round the ramp's ends to whole dims, as transformers does by default."""

    def rope_scale(self) -> float:
        """transformers' YaRN attention factor: it multiplies cos and sin, so the rotary dims of
        q and k. Given outright, else ``mscale(mscale) / mscale(mscale_all_dim)`` when both are
        set (1 for DeepSeek V3), else ``mscale(1)``."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            numerator = yarn_mscale(self.factor, self.mscale)
            return numerator / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 without stretching)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling | YarnScaling | None = None
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, numerically equal to transformers' init
    (default, Llama 3 and YaRN).

    Llama 3: wavelengths shorter than ``original / high_freq_factor`` are kept, those longer than
    ``original / low_freq_factor`` are divided by ``factor``, and the band between is a linear
    blend of the two in ``original / wavelength``.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, YarnScaling):
        return _yarn_inv_freq(head_dim, theta, scaling)
    s = scaling
    wavelen = 2 * math.pi / inv_freq
    blend = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - blend) * inv_freq / s.factor + blend * inv_freq
    is_long = wavelen > s.original_max_position_embeddings / s.low_freq_factor
    is_short = wavelen < s.original_max_position_embeddings / s.high_freq_factor
    return torch.where(is_short, inv_freq, torch.where(is_long, inv_freq / s.factor, smoothed))


def _yarn_inv_freq(head_dim: int, theta: float, s: YarnScaling) -> torch.Tensor:
    """Blend of the original and the ``factor``-interpolated frequencies: the original's share
    falls linearly from 1 to 0 between the dims that rotate ``beta_fast`` and ``beta_slow`` times
    over the original context. Same operations in the same order as transformers, so equal bits.
    """

    def dim_of(rotations: float) -> float:
        wavelength = s.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(wavelength) / (2 * math.log(theta))

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a one-dim ramp would divide by zero
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    original_share = 1 - ramp
    interpolated, original = 1.0 / (s.factor * pos_freqs), 1.0 / pos_freqs
    return interpolated * (1 - original_share) + original * original_share


def rope_cos_sin(
    inv_freq: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [batch, seq, head_dim] in fp32 for integer positions [batch, seq]."""
    freqs = position_ids[..., None].float() * inv_freq.float()
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def mrope_cos_sin(
    inv_freq: torch.Tensor, position_ids: torch.Tensor, sections: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal rotary (Qwen3-VL, Qwen3.5): cos and sin [batch, seq, 2 * n_freq] for positions
    [3, batch, seq] along (time, height, width), or [batch, seq] text positions (all three
    axes equal, which gives plain rotary).

    The frequencies are interleaved over the axes: frequency i follows the height axis when
    i % 3 == 1 and i < 3 * sections[1], the width axis when i % 3 == 2 and
    i < 3 * sections[2], and time otherwise.
    """
    if position_ids.dim() == 2:
        position_ids = position_ids.expand(3, -1, -1)
    freqs = position_ids[..., None].float() * inv_freq.float()  # [3, b, s, n_freq]
    i = torch.arange(inv_freq.numel(), device=freqs.device)
    axis = torch.zeros_like(i)
    for a in (1, 2):
        axis = torch.where((i % 3 == a) & (i < 3 * sections[a]), a, axis)
    freqs = freqs.gather(0, axis.expand(1, *freqs.shape[1:])).squeeze(0)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    impl: Impl | None = None,
) -> torch.Tensor:
    """Rotate x [batch, seq, heads, head_dim]; cos/sin are cast to x's dtype first, as HF does.

    cos/sin narrower than head_dim (partial rotary): only the first ``cos.shape[-1]`` dims of
    each head rotate, the rest pass through.

    ``interleaved``: x holds each rotated pair in adjacent dims (2i, 2i + 1), DeepSeek's layout.
    The result is then in the rotate-half layout (even dims, then odd ones), as transformers
    returns it; attention scores are unchanged, since q and k are permuted alike.

    ``impl``: the rotation's kernel (``ctx.kernels.rope``; None: the reference).
    """
    if interleaved:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat((rotate(x[..., :rotary], cos, sin, impl), x[..., rotary:]), dim=-1)
    return rotate(x, cos, sin, impl)
