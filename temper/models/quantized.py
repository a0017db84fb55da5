"""Block-scaled FP8 and FP4 weights (DeepSeek V3's and V4's released checkpoints), dequantized
on read.

A folder whose config.json says ``quantization_config.quant_method: fp8`` stores a weight
``X.weight`` with its scales beside it, as ``X.weight_scale_inv`` (transformers' name) or
``X.scale`` (DeepSeek's own). Two layouts, told apart by the weight's dtype:

- FP8 (``float8_e4m3fn``) [rows, cols] with one scale per ``weight_block_size`` block (128 x
  128), the scale grid [ceil(rows / 128), ceil(cols / 128)]: the last row and column of blocks
  may be ragged.
- FP4 (int8 or uint8) [rows, cols / 2], two e2m1 codes per byte, low nibble first, with one
  scale per row and group of columns, [rows, cols / group] (V4's routed experts, group 32).

Scales are fp32 or e8m0 (powers of two). The value is ``code * scale``, computed in fp32 (an
e8m0 scale makes it exact) and cast to the parameter's dtype by the loader, one tensor at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from temper.models.safetensors_io import SafetensorsFolder, WeightError, check_finite

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The e2m1 magnitudes of codes 0-7; codes 8-15 are their negatives (the top bit is the sign)."""
DEFAULT_BLOCK = (128, 128)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: Sequence[int]) -> torch.Tensor:
    """FP8 ``weight`` [rows, cols] times its per-block ``scale`` [ceil(rows / b0),
    ceil(cols / b1)], in fp32; edge blocks may be ragged."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape) != grid:
        raise ValueError(
            f"scale shape {list(scale.shape)} does not fit weight {[rows, cols]} in "
            f"{list(block)} blocks (expected {list(grid)})"
        )
    full = scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)
    return weight.float() * full[:, :cols]


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 ``packed`` [rows, cols / 2] (two codes a byte, low nibble first) times
    ``scale`` [rows, cols / group], in fp32 [rows, cols]."""
    rows, half = packed.shape
    if scale.dim() != 2 or scale.shape[0] != rows or (2 * half) % scale.shape[1]:
        raise ValueError(
            f"FP4 scale shape {list(scale.shape)} does not fit {rows} rows of {2 * half} values"
        )
    lut = torch.tensor(FP4_VALUES, device=packed.device)
    lut = torch.cat([lut, -lut])
    octets = packed.view(torch.uint8).int()
    values = lut[torch.stack([octets & 0x0F, octets >> 4], dim=-1)].flatten(-2)
    group = 2 * half // scale.shape[1]
    return values * scale.float().repeat_interleave(group, 1)


def scale_key(key: str, stored: set[str] | SafetensorsFolder) -> str | None:
    """The scale stored beside weight ``key`` (``X.weight_scale_inv`` or ``X.scale``), if any."""
    if not key.endswith(".weight"):
        return None
    for name in (key + "_scale_inv", key.removesuffix("weight") + "scale"):
        if name in stored:
            return name
    return None


class BlockScaledFolder:
    """A ``SafetensorsFolder`` in which every weight with a stored scale reads as its
    dequantized fp32 tensor and the scales are hidden; other tensors read as they are. A read
    of some rows (a sharded parameter's) dequantizes only the blocks holding them."""

    def __init__(self, tensors: SafetensorsFolder, block: Sequence[int] = DEFAULT_BLOCK) -> None:
        self.tensors = tensors
        self.folder = tensors.folder
        self.block = tuple(block)
        stored = set(tensors.keys())
        self.scale_of = {k: s for k in stored if (s := scale_key(k, stored)) is not None}
        self._plain = stored - set(self.scale_of.values())

    def keys(self) -> list[str]:
        return sorted(self._plain)

    def __contains__(self, key: str) -> bool:
        return key in self._plain

    def shape(self, key: str) -> tuple[int, ...]:
        shape = self.tensors.shape(key)
        if key in self.scale_of and self._is_fp4(key):
            return (*shape[:-1], 2 * shape[-1])
        return shape

    def dtype(self, key: str) -> torch.dtype:
        return torch.float32 if key in self.scale_of else self.tensors.dtype(key)

    def read(self, key: str, rows: slice | None = None) -> torch.Tensor:
        scale = self.scale_of.get(key)
        if scale is None:
            return self.tensors.read(key, rows)
        n = self.tensors.shape(key)[0]
        start, stop, _ = (rows or slice(None)).indices(n)
        step = 1 if self._is_fp4(key) else self.block[0]
        first = start // step
        weight = self.tensors.read(key, slice(first * step, stop))
        scales = self.tensors.read(scale, slice(first, -(-stop // step)))
        try:
            if self._is_fp4(key):
                value = dequantize_fp4(weight, scales)
            else:
                value = dequantize_fp8(weight, scales, self.block)
        except ValueError as err:
            raise WeightError(f"{self.folder}: tensor {key!r} with {scale!r}: {err}") from err
        value = value[start - first * step :]
        # An e8m0 scale of 255 is its NaN.
        check_finite(value, f"{self.folder}: tensor {key!r} (dequantized with {scale!r})")
        return value

    def _is_fp4(self, key: str) -> bool:
        return self.tensors.dtype(key) in (torch.int8, torch.uint8)


def quantized_view(tensors: SafetensorsFolder, quantization: dict[str, Any]) -> BlockScaledFolder:
    """The dequantizing view for a config's ``quantization_config``; ValueError naming a
    method or format that is not read here."""
    method = quantization.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"{tensors.folder}: quantization_config.quant_method {method!r} is not supported "
            "(fp8, with FP4 experts, and mxfp4 are)"
        )
    fmt = quantization.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(
            f"{tensors.folder}: quantization_config.fmt {fmt!r} is not supported (e4m3 is)"
        )
    block = quantization.get("weight_block_size") or DEFAULT_BLOCK
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(
            f"{tensors.folder}: quantization_config.weight_block_size {block!r} is not two "
            "positive integers"
        )
    return BlockScaledFolder(tensors, tuple(block))
