"""FP8 for the routed experts' grouped GEMMs (torchao's rowwise FP8 scaled grouped GEMM).

``Float8GroupedExperts`` is ``GroupedExperts`` with the same weights (plain parameters, so
FSDP2, expert parallelism, checkpoints and HF export see the model they always did) whose
three grouped GEMMs run through ``torchao.prototype.moe_training``'s differentiable FP8
grouped GEMM: each operand cast to float8 e4m3 with one power-of-two scale per row, a scaled
grouped GEMM, bf16 out; backward likewise. That kernel needs every expert's group of rows
to be a multiple of 16, so the rows are first spread into groups padded with zero rows
(``padded_grouped_mm``) and the padding dropped after. It runs on CUDA sm90+ only (H100,
H200): torchao has no emulation of it, so CPU tests check the conversion and the padding
(against the plain grouped GEMM), not the FP8 numerics.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from temper.kernels.dispatch import REFERENCE, Kernels
from temper.kernels.swiglu import swiglu
from temper.models.layers.experts import GroupedExperts

GroupedGemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

GROUP_ALIGN = 16
"""Rows per expert group must be a multiple of this for torchao's FP8 grouped GEMM."""


def padded_grouped_mm(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, gemm: GroupedGemm
) -> torch.Tensor:
    """``gemm(x, w, offsets)`` computed with every group padded by zero rows to a multiple of
    ``GROUP_ALIGN``: x [T, K], w [G, K, N], offsets [G] int32 cumulative group ends. The padded
    buffer has a fixed bound (T + G * GROUP_ALIGN rows, no host sync); rows past the last group
    are zeros the GEMM leaves alone (they belong to no group)."""
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    padded_offsets = padded.cumsum(0, dtype=torch.int32)
    starts, padded_starts = offsets - counts, padded_offsets - padded
    group = torch.repeat_interleave(
        torch.arange(len(counts), device=x.device), counts, output_size=x.shape[0]
    )
    rows = torch.arange(x.shape[0], device=x.device) - starts[group] + padded_starts[group]
    capacity = x.shape[0] + len(counts) * GROUP_ALIGN
    spread = x.new_zeros(capacity, x.shape[1]).index_copy(0, rows, x)
    return gemm(spread, w, padded_offsets)[rows]


def float8_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """torchao's FP8 rowwise grouped GEMM, bf16 out: x [T, K] row-major, w [G, K, N] (an
    expert's [N, K] weight transposed, which is the column-major layout it asks for)."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    return _to_fp8_rowwise_then_scaled_grouped_mm(
        x.to(torch.bfloat16).contiguous(),
        w.to(torch.bfloat16),
        offsets,
        out_dtype=torch.bfloat16,
        pad_token_groups_for_grouped_mm=False,
    )


class Float8GroupedExperts(GroupedExperts):
    """``GroupedExperts`` whose grouped GEMMs run in FP8 (``gemm``: the FP8 kernel, or
    another grouped GEMM with its contract, which the tests pass)."""

    gemm: GroupedGemm = staticmethod(float8_grouped_mm)

    def forward(
        self, x: torch.Tensor, offsets: torch.Tensor, kernels: Kernels = REFERENCE
    ) -> torch.Tensor:
        w1, w3, w2 = (
            w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w3, self.w2)
        )

        def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return padded_grouped_mm(a, w.mT, offsets, self.gemm)

        return mm(swiglu(mm(x, w1), mm(x, w3), kernels.swiglu), w2)


def apply_float8_experts(model: nn.Module) -> list[str]:
    """Replace every ``GroupedExperts`` of ``model`` (exactly that class: gpt-oss's clamped
    experts, with biases, keep theirs) by a ``Float8GroupedExperts`` holding the same
    parameters; returns their names. Routers, shared experts and gates are not touched."""
    chosen = [(n, m) for n, m in model.named_modules() if type(m) is GroupedExperts]
    for name, module in chosen:
        n_experts, hidden_dim, dim = module.w1.shape
        with torch.device("meta"):
            fp8 = Float8GroupedExperts(dim, hidden_dim, n_experts)
        fp8.w1, fp8.w3, fp8.w2 = module.w1, module.w3, module.w2
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, fp8)
    return [name for name, _ in chosen]
