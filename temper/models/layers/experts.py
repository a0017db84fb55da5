"""The experts of the MoE layer (``temper.models.layers.moe.MoE``) and the steps around them:
``permute`` tokens by expert, the experts' grouped GEMMs over stacked weights, and the
dispatcher between the two, local (``run_local``) or expert-parallel
(``temper.parallel.expert``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from temper.kernels.dispatch import REFERENCE, Impl, Kernels
from temper.kernels.grouped_gemm import grouped_mm
from temper.kernels.moe_permute import permute as permute_rows
from temper.kernels.swiglu import swiglu
from temper.models.layers.init import trunc_normal_

Experts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""An experts module's forward (rows sorted by expert, offsets) -> outputs, bound to the
forward's kernel choices (``MoE.forward``): what an ``ExpertDispatcher`` runs."""


def limited_swiglu(
    gate: torch.Tensor, up: torch.Tensor, limit: float | None, impl: Impl | None = None
) -> torch.Tensor:
    """``silu(gate) * up`` with, given a ``limit``, gate clamped to at most ``limit`` and up to
    [-limit, limit] first (DeepSeek V4's ``swiglu_limit``); ``impl``: the SwiGLU's kernel."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return swiglu(gate, up, impl)


class GroupedExperts(nn.Module):
    """SwiGLU experts as stacked weights, each in nn.Linear's [out, in] layout so HF's
    per-expert tensors stack without a transpose: w1 (gate), w3 (up) [E, hidden, dim] and
    w2 (down) [E, dim, hidden]. ``limit``: clamp the SwiGLU's inputs (``limited_swiglu``)."""

    def __init__(
        self, dim: int, hidden_dim: int, n_experts: int, limit: float | None = None
    ) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))

    def init_weights(self, std: float, out_std: float) -> None:
        """``out_std`` is for ``w2``, which writes into the residual stream."""
        for w, s in ((self.w1, std), (self.w3, std), (self.w2, out_std)):
            trunc_normal_(w, s)

    def forward(
        self, x: torch.Tensor, offsets: torch.Tensor, kernels: Kernels = REFERENCE
    ) -> torch.Tensor:
        """Rows of x [T, dim] sorted by expert; ``offsets`` [E] int32 cumulative group ends;
        the SwiGLU runs as ``kernels`` says."""
        # Under expert parallelism the weights are DTensors sharded by expert; the rows sent
        # here are for this rank's experts only, so the GEMMs take the local shard.
        w1, w3, w2 = (
            w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w3, self.w2)
        )
        gate, up = grouped_mm(x, w1.mT, offsets), grouped_mm(x, w3.mT, offsets)
        h = limited_swiglu(gate, up, self.limit, kernels.swiglu)
        return grouped_mm(h, w2.mT, offsets)


def permute(
    x: torch.Tensor, experts: torch.Tensor, n_experts: int, impl: Impl | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copy each token once per chosen expert, grouped by expert (token order kept within one).

    x [n, dim], experts [n, k] -> rows [n * k, dim], ``order`` (the flat (token, slot) index of
    each row, for ``unpermute``) and tokens per expert [E] (int64, no host sync); ``impl``:
    the copy's kernel (None: the reference).
    """
    order = experts.flatten().argsort(stable=True)
    rows = permute_rows(x, order, experts.shape[1], impl)
    return rows, order, tokens_per_expert(experts, n_experts)


def tokens_per_expert(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[n_experts] int64 count of the choices in ``experts`` (any shape), without a host sync."""
    flat = experts.flatten()
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


class ExpertDispatcher(Protocol):
    """Runs ``experts`` on rows sorted by expert, wherever the experts live: in this process
    (`run_local`) or across an expert-parallel group (`temper.parallel.expert`)."""

    def __call__(self, experts: Experts, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [T, dim] sorted by expert, counts [E] tokens per expert -> outputs [T, dim]."""
        ...


def run_local(experts: Experts, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Every expert is here: one grouped GEMM pass over all rows."""
    return experts(rows, counts.cumsum(0, dtype=torch.int32))
