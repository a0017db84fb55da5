"""Whole-matrix work on row-sharded (FSDP / HSDP) matrices: each matrix once, on one rank.

Newton-Schulz needs a whole matrix, while FSDP gives each rank a slice of its rows (and HSDP
the same slices to every replica). Gathering every matrix on every rank repeats the work as
many times as there are ranks. Instead each matrix gets one owner among all the mesh's ranks
(replicas included); one all-to-all brings the owner the slices of its matrices from the
ranks of its replica, the owner computes, and a second all-to-all sends every rank its slice
of each result. Work is spread by size (greedy on the Newton-Schulz cost) or round-robin.

Per rank, with S shards and N = R x S ranks, each matrix costs (S-1)/S of its size for the
gather (at its owner) and (N-1)/S for the scatter, against N (S-1)/S for an all-gather on
every rank: the same bytes at S = 2, 2/S of them beyond, and 1/N of the compute always.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard


@dataclass
class CommStats:
    """One rank's bytes for one optimizer step (self-sends excluded)."""

    sent: int = 0
    received: int = 0
    all_gather_received: int = 0
    """What this rank would receive if every rank gathered every sharded matrix whole (in
    the same dtype): the reference the design is measured against."""
    matrices: int = 0
    """Row-sharded matrices this rank orthogonalized."""


def row_shard_dim(param: torch.Tensor) -> int | None:
    """The mesh dim that splits ``param``'s rows, or None when this rank holds whole matrices
    (a plain tensor, a replicated one, or stacked experts split by expert only).

    A 2-D DTensor split any other way is refused: its slices are not rows of one matrix.
    """
    if not isinstance(param, DTensor):
        return None
    if param.to_local().shape[-2:] == param.shape[-2:]:
        return None
    shard = [i for i, p in enumerate(param.placements) if isinstance(p, Shard) and p.dim == 0]
    others = [p for i, p in enumerate(param.placements) if i not in shard]
    if param.ndim != 2 or len(shard) != 1 or not all(isinstance(p, Replicate) for p in others):
        raise ValueError(
            f"Muon needs whole matrices or FSDP row shards; got a parameter of shape "
            f"{tuple(param.shape)} placed {param.placements} on {param.device_mesh}"
        )
    return shard[0]


def rows_of(n_rows: int, n_shards: int, index: int) -> tuple[int, int]:
    """(start, size) of shard ``index``'s rows: torch.chunk's split, which DTensor uses."""
    chunk = -(-n_rows // n_shards)
    start = min(n_rows, index * chunk)
    return start, min(chunk, n_rows - start)


def assign_owners(
    shapes: list[torch.Size], n_ranks: int, rule: Literal["size", "round_robin"]
) -> list[int]:
    """Owner position of each matrix: round-robin, or by size (largest Newton-Schulz cost
    first, each to the least loaded rank; the lowest position breaks ties)."""
    if rule == "round_robin":
        return [i % n_ranks for i in range(len(shapes))]
    cost = [s[0] * s[1] * min(s[0], s[1]) for s in shapes]
    load = [0] * n_ranks
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: -cost[i]):
        owners[i] = min(range(n_ranks), key=lambda r: (load[r], r))
        load[owners[i]] += cost[i]
    return owners


class RowShardedMatrices:
    """Runs a whole-matrix function on matrices row-sharded over one dim of ``mesh``."""

    def __init__(self, mesh: DeviceMesh, shard_dim: int) -> None:
        self.ranks: list[int] = mesh.mesh.flatten().tolist()  # global rank per mesh position
        self.coords = list(itertools.product(*(range(n) for n in mesh.mesh.shape)))
        self.dim = shard_dim
        self.n_shards = mesh.mesh.shape[shard_dim]
        self.me = self.ranks.index(dist.get_rank())
        world = dist.get_world_size()
        self.group = (
            None if sorted(self.ranks) == list(range(world)) else dist.new_group(sorted(self.ranks))
        )
        # all_to_all lists go in group-rank order; position -> that order.
        self.order = sorted(range(len(self.ranks)), key=self._group_rank)

    def _group_rank(self, position: int) -> int:
        rank = self.ranks[position]
        return rank if self.group is None else dist.get_group_rank(self.group, rank)

    def _replica(self, position: int) -> tuple[int, ...]:
        coord = self.coords[position]
        return coord[: self.dim] + coord[self.dim + 1 :]

    def _shard(self, position: int) -> int:
        return self.coords[position][self.dim]

    def orthogonalize(
        self,
        local: list[torch.Tensor],
        shapes: list[torch.Size],
        fn: Callable[[torch.Tensor], torch.Tensor],
        *,
        dtype: torch.dtype,
        assign: Literal["size", "round_robin"],
        stats: CommStats,
    ) -> list[torch.Tensor]:
        """``fn`` of each whole matrix, as this rank's rows of it.

        ``local[i]`` is this rank's rows of matrix ``i`` (``shapes[i]``); every rank passes
        the same matrices in the same order. Slices travel in ``dtype``: ``fn`` must start by
        casting to it (Newton-Schulz does), so casting first changes nothing but the bytes.
        """
        n = len(self.ranks)
        owners = assign_owners(shapes, n, assign)
        mine = [i for i, owner in enumerate(owners) if owner == self.me]
        me_replica = self._replica(self.me)

        def numel(i: int, position: int) -> int:
            return rows_of(shapes[i][0], self.n_shards, self._shard(position))[1] * shapes[i][1]

        # Gather: the ranks of the owner's replica send it their rows.
        send = [
            [
                local[i].reshape(-1).to(dtype)
                for i in range(len(local))
                if owners[i] == dest and self._replica(dest) == me_replica
            ]
            for dest in range(n)
        ]
        sources = [s for s in range(n) if self._replica(s) == me_replica]
        recv = [sum(numel(i, s) for i in mine) if s in sources else 0 for s in range(n)]
        like = torch.empty(0, dtype=dtype, device=local[0].device)
        received = self._all_to_all(send, recv, like, stats)
        parts = {s: received[s].split([numel(i, s) for i in mine]) for s in sources}
        results = {}
        for j, i in enumerate(mine):
            rows = [parts[s][j].view(-1, shapes[i][1]) for s in sorted(sources, key=self._shard)]
            results[i] = fn(torch.cat(rows))
        stats.matrices += len(mine)

        # Scatter: every rank (every replica) gets its rows of each result.
        send = []
        for dest in range(n):
            pieces = []
            for i in mine:
                start, size = rows_of(shapes[i][0], self.n_shards, self._shard(dest))
                pieces.append(results[i][start : start + size].reshape(-1))
            send.append(pieces)
        recv = [
            sum(numel(i, self.me) for i in range(len(local)) if owners[i] == s) for s in range(n)
        ]
        received = self._all_to_all(send, recv, like, stats)
        by_source = {
            s: iter(
                received[s].split([numel(i, self.me) for i in range(len(local)) if owners[i] == s])
            )
            for s in range(n)
        }
        out = [next(by_source[owners[i]]).view(local[i].shape) for i in range(len(local))]

        size = torch.empty((), dtype=dtype).element_size()
        stats.all_gather_received += size * sum(
            shapes[i].numel() - local[i].numel() for i in range(len(local))
        )
        return out

    def _all_to_all(
        self,
        send: list[list[torch.Tensor]],
        recv: list[int],
        like: torch.Tensor,
        stats: CommStats,
    ) -> list[torch.Tensor]:
        """One uneven all-to-all of ``like``'s dtype and device; lists indexed by mesh
        position, like its result."""
        dtype, device = like.dtype, like.device
        flat = [
            torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
            for pieces in send
        ]
        inputs = torch.cat([flat[p] for p in self.order])
        output = torch.empty(sum(recv), dtype=dtype, device=device)
        dist.all_to_all_single(
            output,
            inputs,
            output_split_sizes=[recv[p] for p in self.order],
            input_split_sizes=[flat[p].numel() for p in self.order],
            group=self.group,
        )
        size = output.element_size()
        stats.sent += size * sum(f.numel() for p, f in enumerate(flat) if p != self.me)
        stats.received += size * sum(r for p, r in enumerate(recv) if p != self.me)
        chunks = output.split([recv[p] for p in self.order])
        return [chunks[self.order.index(p)] for p in range(len(recv))]
