"""Manifold-constrained hyper-connections (mHC, DeepSeek V4): the residual stream is ``n``
parallel streams ``X`` [b, s, n, dim] instead of one.

Around each attention or MLP block ``F``, one linear map of the RMS-normalized, flattened
streams gives three sets of mixing weights per token:

    pre  = sigmoid(a_pre * m_pre + b_pre) + eps                 [n]     streams -> block input
    post = 2 * sigmoid(a_post * m_post + b_post)                [n]     block output -> streams
    comb = sinkhorn(softmax(a_comb * m_comb + b_comb) + eps)    [n, n]  streams -> streams

    X' = post * F(sum_j pre_j X_j) + comb^T X

``comb`` is pushed towards a doubly stochastic matrix (rows and columns summing to 1) by
Sinkhorn-Knopp iterations, so mixing the streams cannot grow their norm through depth. At the
top, the ``HyperHead`` collapses the streams once more with its own ``pre`` weights.

The weights are computed in fp32 whatever the compute dtype, as transformers keeps them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _normalized_flat(streams: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """The streams [b, s, n, dim] flattened to [b, s, n * dim] in fp32, RMS-normalized with no
    gain: what the mixing weights are read from."""
    flat = streams.flatten(2).float()
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)


def sinkhorn(m: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``iters`` Sinkhorn-Knopp normalizations of positive matrices m [..., n, n]: the columns
    first, then ``iters - 1`` rounds of rows and columns (transformers' order)."""
    m = m / (m.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(-1, keepdim=True) + eps)
        m = m / (m.sum(-2, keepdim=True) + eps)
    return m


class HyperConnection(nn.Module):
    """The mixing weights around one block (module docstring): ``fn`` [(2 + n) * n, n * dim]
    maps the normalized streams to (pre, post, comb), ``base`` their biases, ``scale`` one
    factor for each of the three."""

    def __init__(
        self, dim: int, n_streams: int, *, sinkhorn_iters: int, eps: float, norm_eps: float
    ) -> None:
        super().__init__()
        self.n_streams = n_streams
        self.sinkhorn_iters = sinkhorn_iters
        self.eps = eps
        self.norm_eps = norm_eps
        n_weights = (2 + n_streams) * n_streams
        self.fn = nn.Parameter(torch.empty(n_weights, n_streams * dim))
        self.base = nn.Parameter(torch.empty(n_weights))
        self.scale = nn.Parameter(torch.empty(3))

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.fn, std=std)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [b, s, n, dim] -> (the block's input [b, s, dim] in the streams' dtype,
        post [b, s, n] and comb [b, s, n, n] in fp32, for ``residual``)."""
        n = self.n_streams
        mix = F.linear(_normalized_flat(streams, self.norm_eps), self.fn.float())
        m_pre, m_post, m_comb = mix.split([n, n, n * n], dim=-1)
        b_pre, b_post, b_comb = self.base.float().split([n, n, n * n])
        a_pre, a_post, a_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(m_pre * a_pre + b_pre) + self.eps
        post = 2 * torch.sigmoid(m_post * a_post + b_post)
        logits = (m_comb * a_comb + b_comb).unflatten(-1, (n, n))
        comb = sinkhorn(logits.softmax(-1) + self.eps, self.sinkhorn_iters, self.eps)
        block_input = (pre.unsqueeze(-1) * streams).sum(2).to(streams.dtype)
        return block_input, post, comb


def residual(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """The streams after a block: ``post * out + comb^T streams`` [b, s, n, dim], from the block
    output ``out`` [b, s, dim] and the weights ``HyperConnection`` gave for its input."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + comb.to(dtype).mT @ streams


class HyperHead(nn.Module):
    """The last collapse of the streams into one hidden state, before the final norm:
    ``sum_j pre_j X_j`` with ``pre`` as in ``HyperConnection`` (``fn`` [n, n * dim])."""

    def __init__(self, dim: int, n_streams: int, *, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.norm_eps = norm_eps
        self.fn = nn.Parameter(torch.empty(n_streams, n_streams * dim))
        self.base = nn.Parameter(torch.empty(n_streams))
        self.scale = nn.Parameter(torch.empty(1))

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.fn, std=std)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [b, s, n, dim] -> [b, s, dim] in their dtype."""
        mix = F.linear(_normalized_flat(streams, self.norm_eps), self.fn.float())
        pre = torch.sigmoid(mix * self.scale.float() + self.base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(2).to(streams.dtype)
