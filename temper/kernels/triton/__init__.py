"""Triton forms of the fused ops (CUDA; also Triton's CPU interpreter, ``TRITON_INTERPRET=1``).

Imported only when the dispatcher picks ``triton``, so Triton stays an optional dependency.
Each op is a ``torch.autograd.Function`` with explicit forward and backward kernels that keep
only what the backward needs; parity with the references is in tests/unit/test_kernels_triton.py.
"""

from __future__ import annotations

import torch


def num_warps(block: int) -> int:
    """Warps for a program that reduces ``block`` elements: more lanes for longer rows."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


def program_count(device: torch.device) -> int:
    """Persistent programs for row-strip kernels: a few per SM (4 under the CPU interpreter)."""
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count
