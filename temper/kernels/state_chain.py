"""A recurrence over a sequence split across context-parallel (CP) ranks in the load-balanced
layout (``temper.kernels.ring_attention.load_balanced_indices``): rank r holds chunks r and
``2cp - 1 - r``, so the chunk order c0, c1, ..., c(2cp-1) visits ranks 0, 1, ..., cp-1,
cp-1, ..., 1, 0. ``state_chain`` runs a step on each chunk in that order, passing a carry
(a recurrent state, a convolution window) from the rank holding chunk c to the one holding
c + 1; its backward passes the carry's gradient back in reverse order.

Each rank has one neighbour before and one after each of its chunks, and the order is a
line, never a cycle, so blocking point-to-point sends and receives cannot deadlock. The
chunks are sequential: a rank idles while earlier chunks run (the price of an exact
recurrence; the step's token-parallel work is not overlapped).

The backward is a custom autograd function rather than autograd through point-to-point ops,
whose order each rank's autograd engine would choose: it keeps the inputs and the carries
entering each chunk, and recomputes each chunk's step under autograd when its carry's
gradient arrives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

Carry = tuple[torch.Tensor, ...]
Step = Callable[
    [int, Sequence[torch.Tensor], Sequence[torch.Tensor], Carry], tuple[torch.Tensor, Carry]
]
"""``step(half, shared, local, carry) -> (out, carry_out)``: ``half`` 0 is the rank's early
chunk, 1 its late one; ``local`` the chunk's part of each local input."""


def state_chain(
    step: Step,
    shared: Sequence[torch.Tensor],
    local: Sequence[torch.Tensor],
    carry: Carry,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """``step`` over this rank's two chunks in the global chunk order, the carry passing
    between ranks. ``shared``: inputs every chunk reads whole (weights; their gradient sums
    over the chunks); ``local``: [b, s, ...] inputs of this rank's ``s`` tokens (its two
    chunks, ``s / 2`` each); ``carry``: the zero carry entering chunk 0. Returns the two
    chunks' outputs concatenated on dim 1."""
    n_shared = len(shared)
    return _StateChain.apply(step, group, n_shared, len(carry), *shared, *local, *carry)


class _Neighbours:
    """Who precedes and follows each of this rank's chunks: a global rank, ``"local"`` (the
    rank's other chunk) or None (the sequence's start or end)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group = group

        def peer(r: int) -> int:
            return dist.get_global_rank(group, r)

        last = rank == size - 1
        self.before: tuple[int | str | None, ...] = (
            None if rank == 0 else peer(rank - 1),
            "local" if last else peer(rank + 1),
        )
        self.after: tuple[int | str | None, ...] = (
            "local" if last else peer(rank + 1),
            None if rank == 0 else peer(rank - 1),
        )

    def receive(self, source: int | str | None, like: Carry, local: Carry | None) -> Carry:
        """The carry from ``source``: zeros shaped like ``like`` at the sequence's ends, the
        rank's own ``local`` one, or received."""
        if source is None:
            return tuple(torch.zeros_like(t) for t in like)
        if source == "local":
            assert local is not None
            return local
        received = tuple(torch.empty_like(t) for t in like)
        for t in received:
            dist.recv(t, src=source, group=self.group)
        return received

    def send(self, target: int | str | None, carry: Carry) -> None:
        if isinstance(target, int):
            for t in carry:
                dist.send(t.contiguous(), dst=target, group=self.group)


class _StateChain(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        step: Step,
        group: dist.ProcessGroup,
        n_shared: int,
        n_carry: int,
        *tensors: torch.Tensor,
    ) -> torch.Tensor:
        shared, local = tensors[:n_shared], tensors[n_shared : len(tensors) - n_carry]
        zero = tensors[len(tensors) - n_carry :]
        ways = _Neighbours(group)
        halves = [t.chunk(2, dim=1) for t in local]
        outs, entering = [], []
        carry_out: Carry | None = None
        for half in (0, 1):
            carry_in = ways.receive(ways.before[half], zero, carry_out)
            entering.append(carry_in)
            out, carry_out = step(half, shared, [h[half] for h in halves], carry_in)
            ways.send(ways.after[half], carry_out)
            outs.append(out)
        ctx.step, ctx.ways, ctx.n_shared, ctx.n_local = step, ways, n_shared, len(local)
        ctx.save_for_backward(*shared, *local, *entering[0], *entering[1])
        return torch.cat(outs, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors
        n_shared, n_local = ctx.n_shared, ctx.n_local
        shared, local = saved[:n_shared], saved[n_shared : n_shared + n_local]
        carries = saved[n_shared + n_local :]
        n_carry = len(carries) // 2
        entering = (carries[:n_carry], carries[n_carry:])
        ways: _Neighbours = ctx.ways
        halves = [t.chunk(2, dim=1) for t in local]
        grad_halves = grad.chunk(2, dim=1)
        grad_shared: list[torch.Tensor | None] = [None] * n_shared
        grad_local: list[list[torch.Tensor]] = [[], []]
        grad_carry_in: Carry | None = None
        for half in (1, 0):
            carry_in = tuple(t.detach().requires_grad_() for t in entering[half])
            grad_carry_out = ways.receive(ways.after[half], carry_in, grad_carry_in)
            inputs = [t.detach().requires_grad_() for t in shared] + [
                h[half].detach().requires_grad_() for h in halves
            ]
            with torch.enable_grad():
                out, carry_out = ctx.step(half, inputs[:n_shared], inputs[n_shared:], carry_in)
                grads = torch.autograd.grad(
                    (out, *carry_out),
                    (*inputs, *carry_in),
                    (grad_halves[half], *grad_carry_out),
                    allow_unused=True,
                )
            grads = [
                torch.zeros_like(x) if g is None else g
                for g, x in zip(grads, (*inputs, *carry_in), strict=True)
            ]
            grad_carry_in = tuple(grads[len(inputs) :])
            ways.send(ways.before[half], grad_carry_in)
            for i in range(n_shared):
                grad_shared[i] = grads[i] if grad_shared[i] is None else grad_shared[i] + grads[i]
            grad_local[half] = grads[n_shared : len(inputs)]
        grad_inputs = [torch.cat(pair, dim=1) for pair in zip(*grad_local, strict=True)]
        return (None, None, None, None, *grad_shared, *grad_inputs, *([None] * len(entering[0])))
