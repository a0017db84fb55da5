"""MXFP4 expert weights (gpt-oss's released checkpoints), dequantized on read.

A tensor ``X`` [..., rows, cols] (cols a multiple of 32) is stored as ``X_blocks``
[..., rows, cols / 32, 16] uint8, two FP4 (e2m1) codes per byte, low nibble first, and
``X_scales`` [..., rows, cols / 32] uint8, one power of two per 32 values (e8m0, bias 127).
gpt-oss stores each expert's weight as [out, in]; transformers' parameters are [in, out], so
the dequantized tensor is transposed on its last two dims, as transformers does.

Every FP4 value times a power of two is exact in fp32 (and in bf16 within its exponent range),
so the result does not depend on the dtype it is computed in.
"""

from __future__ import annotations

import itertools

import torch

from temper.models.safetensors_io import SafetensorsFolder, check_finite

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The e2m1 magnitudes of codes 0-7; codes 8-15 are their negatives (the top bit is the sign)."""
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``blocks`` [..., rows, groups, 16] and ``scales`` [..., rows, groups] -> fp32
    [..., groups * 32, rows] (transposed, see the module docstring)."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} do not fit scales {list(scales.shape)}"
        )
    if blocks.dim() > 3:
        # One expert at a time: the codes' index tensor would be 32 bytes a weight at once.
        *prefix, rows, groups, pair_bytes = blocks.shape
        out = torch.empty(*prefix, groups * pair_bytes * 2, rows, device=blocks.device)
        for index in itertools.product(*map(range, prefix)):
            out[index] = dequantize(blocks[index], scales[index])
        return out
    lut = torch.tensor(FP4_VALUES, device=blocks.device)
    lut = torch.cat([lut, -lut])
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).int()  # low nibble first
    values = lut[codes].flatten(-2)  # [rows, groups, 32]
    exponents = scales.to(torch.int32) - 127
    values = torch.ldexp(values, exponents.unsqueeze(-1))
    return values.flatten(-2).transpose(-1, -2)


class Mxfp4Folder:
    """A ``SafetensorsFolder`` in which every ``X_blocks`` / ``X_scales`` pair reads as the
    dequantized ``X``; other tensors read as they are. Reads of rows (an expert-parallel
    shard's experts) dequantize only those."""

    def __init__(self, tensors: SafetensorsFolder) -> None:
        self.tensors = tensors
        stored = set(tensors.keys())
        self.packed = {
            key.removesuffix(BLOCKS)
            for key in stored
            if key.endswith(BLOCKS) and key.removesuffix(BLOCKS) + SCALES in stored
        }
        self._plain = stored - {
            name + suffix for name in self.packed for suffix in (BLOCKS, SCALES)
        }

    def keys(self) -> list[str]:
        return sorted(self._plain | self.packed)

    def __contains__(self, key: str) -> bool:
        return key in self._plain or key in self.packed

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self.packed:
            return self.tensors.shape(key)
        *prefix, rows, groups, pair_bytes = self.tensors.shape(key + BLOCKS)
        return (*prefix, groups * pair_bytes * 2, rows)

    def dtype(self, key: str) -> torch.dtype:
        return torch.float32 if key in self.packed else self.tensors.dtype(key)

    def read(self, key: str, rows: slice | None = None) -> torch.Tensor:
        if key not in self.packed:
            return self.tensors.read(key, rows)
        value = dequantize(
            self.tensors.read(key + BLOCKS, rows), self.tensors.read(key + SCALES, rows)
        )
        # A scale of 255 (e8m0's NaN) dequantizes to an infinity.
        check_finite(value, f"{self.tensors.folder}: tensor {key + BLOCKS!r} (MXFP4)")
        return value
