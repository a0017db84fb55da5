"""Fused ops, each beside a plain-PyTorch reference that CPU tests compare against."""

from temper.kernels.grouped_gemm import grouped_mm

__all__ = ["grouped_mm"]
