"""gpt-oss's mixture of experts: a router with a bias whose top-k logits are softmaxed, and
experts with biases and a clamped SwiGLU.

The pieces plug into ``temper.models.layers.moe.MoE`` (routing statistics, permutation,
expert-parallel dispatch), which needs only a router's ``(probs, weights, experts)`` and an
experts module taking rows sorted by expert with their group offsets.

The experts keep transformers' layout, ``gate_up`` [E, dim, 2 * hidden] with gate and up in
alternating columns and ``down`` [E, hidden, dim] (input dim first: ``x @ w``), so HF tensors
load as they are and every parameter is stacked by expert on dim 0, as expert parallelism
shards it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from temper.kernels.dispatch import REFERENCE, Kernels
from temper.kernels.grouped_gemm import grouped_mm
from temper.models.layers.init import init_linear, trunc_normal_


@dataclass(frozen=True)
class ClampedSwiGLU:
    """``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


class BiasedTopKRouter(nn.Module):
    """Logits ``gate(x)`` with a bias; the k largest are softmaxed into the weights.

    The probabilities it reports (for the load-balancing loss) are the softmax over all
    experts in fp32, as transformers' aux loss takes them.
    """

    def __init__(self, dim: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, n_experts, bias=True)

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [n, dim] -> probabilities [n, E] (fp32), weights [n, k] (x's dtype), experts [n, k].
        ``experts`` [n, k] (router replay): softmax these experts' logits, not the top k's."""
        logits = self.gate(x)
        if experts is None:
            top, experts = logits.topk(self.top_k, dim=-1)
        else:
            top = logits.gather(1, experts)
        weights = top.softmax(dim=-1)
        return logits.softmax(dim=-1, dtype=torch.float32), weights, experts

    def init_weights(self, std: float) -> None:
        init_linear(self.gate, std)


class ClampedSwiGLUExperts(nn.Module):
    """Experts ``down(act(x gate_up + b)) + b`` with the clamped SwiGLU ``act``."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, act: ClampedSwiGLU) -> None:
        super().__init__()
        self.act = act
        self.gate_up = nn.Parameter(torch.empty(n_experts, dim, 2 * hidden_dim))
        self.gate_up_bias = nn.Parameter(torch.empty(n_experts, 2 * hidden_dim))
        self.down = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.down_bias = nn.Parameter(torch.empty(n_experts, dim))

    def init_weights(self, std: float, out_std: float) -> None:
        """``out_std`` is for ``down``, which writes into the residual stream."""
        for w, s in ((self.gate_up, std), (self.down, out_std)):
            trunc_normal_(w, s)
        nn.init.zeros_(self.gate_up_bias)
        nn.init.zeros_(self.down_bias)

    def forward(
        self, x: torch.Tensor, offsets: torch.Tensor, kernels: Kernels = REFERENCE
    ) -> torch.Tensor:
        """Rows of x [T, dim] sorted by expert; ``offsets`` [E] int32 cumulative group ends.
        The clamped gate has no fused form: ``kernels`` (the experts' call) changes nothing."""
        # Under expert parallelism these are this rank's shards, and the rows its experts'.
        gate_up, gate_up_bias, down, down_bias = (
            w.to_local() if isinstance(w, DTensor) else w
            for w in (self.gate_up, self.gate_up_bias, self.down, self.down_bias)
        )
        rows = torch.arange(x.shape[0], device=x.device, dtype=offsets.dtype)
        expert = torch.searchsorted(offsets, rows, right=True)
        h = grouped_mm(x, gate_up, offsets) + gate_up_bias[expert]
        h = self.act(h[:, 0::2], h[:, 1::2])
        return grouped_mm(h, down, offsets) + down_bias[expert]
