"""SwiGLU's gate, ``silu(gate) * up``, behind the kernel dispatcher, beside its reference."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from temper.kernels.dispatch import Impl, choose


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu(gate: torch.Tensor, up: torch.Tensor, impl: Impl | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for same-shaped tensors; ``impl`` is the form asked for (None: the
    reference). The fused forms keep only gate and up for backward (the reference also keeps
    ``silu(gate)``)."""
    return choose("swiglu", gate.device, impl, swiglu_reference, _triton)(gate, up)


def _triton() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    from temper.kernels.triton.swiglu import swiglu

    return swiglu
