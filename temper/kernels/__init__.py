"""Fused ops, each beside a plain-PyTorch reference that CPU tests compare against.

``dispatch`` picks each op's implementation (reference, compile, triton) from the run's
``Kernels`` config and the device; docs/kernels.md has the measurements behind its choices.
"""

from temper.kernels.cross_entropy import linear_cross_entropy, linear_log_probs
from temper.kernels.dispatch import Kernels, resolve_kernels
from temper.kernels.grouped_gemm import grouped_mm

__all__ = ["Kernels", "resolve_kernels", "grouped_mm", "linear_cross_entropy", "linear_log_probs"]
