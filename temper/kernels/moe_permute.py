"""MoE token movement behind the kernel dispatcher: rows gathered by expert, and the weighted
sum of each token's expert outputs back in token order.

``order`` is the flat (token, slot) index of each expert-sorted row, as
``experts.flatten().argsort(stable=True)`` gives it; ``top_k`` slots per token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from temper.kernels.dispatch import Impl, choose


def permute_reference(x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """x [n, dim] -> rows [n * top_k, dim]: row i is token ``order[i] // top_k``.

    Each (token, slot) copy is written to its row, the inverse of ``order``, rather than
    each row gathered by ``order``: the backward is then a gather and a sum over slots,
    where a gather's backward would scatter-add (atomic adds in compiled code)."""
    slots = x.repeat_interleave(top_k, dim=0)  # row t * top_k + s: token t
    return slots.new_empty(slots.shape).index_copy(0, rows_of(order), slots)


def rows_of(order: torch.Tensor) -> torch.Tensor:
    """The inverse of ``order``: the row each (token, slot) went to."""
    rows = torch.empty_like(order)
    rows[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return rows


def unpermute_reference(
    y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Rows back to (token, slot) order, then each token's weighted sum over its k experts.

    A copy to unique positions and a sum over slots, rather than an atomic scatter-add, so the
    result is bitwise repeatable on GPU.
    """
    n, k = weights.shape
    y = y.new_empty(y.shape).index_copy(0, order, y)
    return (y.view(n, k, -1) * weights.unsqueeze(-1)).sum(dim=1)


def permute(
    x: torch.Tensor, order: torch.Tensor, top_k: int, impl: Impl | None = None
) -> torch.Tensor:
    """``permute_reference`` through the dispatcher; ``impl`` is the form asked for (None:
    the reference)."""
    return choose("moe_permute", x.device, impl, permute_reference, _triton_permute)(
        x, order, top_k
    )


def unpermute(
    y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, impl: Impl | None = None
) -> torch.Tensor:
    """``unpermute_reference`` through the dispatcher: rows [n * k, dim] and weights [n, k]
    -> [n, dim]; ``impl`` is the form asked for (None: the reference)."""
    return choose("moe_permute", y.device, impl, unpermute_reference, _triton_unpermute)(
        y, order, weights
    )


def _triton_permute() -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
    from temper.kernels.triton.moe_permute import permute

    return permute


def _triton_unpermute() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    from temper.kernels.triton.moe_permute import unpermute

    return unpermute
