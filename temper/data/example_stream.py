"""Rows built from an in-memory list of examples in a seeded order, sharded by rows and
resumable: the stream of image SFT, whose samples carry pixels and stay whole.

Every rank walks the whole global row order and keeps its share, so its position is the
same on every rank (``merge_states`` takes it as is) and resumes at any data-parallel size.
Text formats use ``temper.data.stream.LaneStream`` instead, where each rank reads only its
own documents.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

Row = dict[str, torch.Tensor]


class ExampleStream:
    """Rows built from a list of examples in a seeded order, sharded and resumable.

    ``build_row(examples, start)`` returns a row and how many examples from ``start`` (in
    the epoch's order) it used; the examples are visited in a fresh permutation per epoch.
    """

    def __init__(
        self,
        examples: Sequence[Any],
        build_row: Callable[[Callable[[int], Any | None]], tuple[Row, int]],
        *,
        seed: int,
        dp_rank: int,
        dp_world: int,
        stats: dict[str, int],
    ) -> None:
        if not examples:
            raise ValueError("no examples left to train on (all were dropped as over-long)")
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"need 0 <= dp_rank < dp_world, got {dp_rank} and {dp_world}")
        self.examples = examples
        self.build_row = build_row
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.stats = stats
        self._epoch = 0
        self._next = 0
        self._row = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(len(self.examples), generator=generator).tolist()

    def _peek(self, offset: int) -> Any | None:
        """The example ``offset`` places after the cursor, within this epoch; else None."""
        index = self._next + offset
        return self.examples[self._order[index]] if index < len(self._order) else None

    def _next_global_row(self) -> Row:
        row, used = self.build_row(self._peek)
        self._next += used
        if self._next == len(self._order):
            self._epoch += 1
            self._next = 0
            self._order = self._permutation(self._epoch)
        self._row += 1
        return row

    def __iter__(self) -> Iterator[Row]:
        while True:
            for _ in range(self.dp_rank):
                self._next_global_row()
            row = self._next_global_row()
            for _ in range(self.dp_world - 1 - self.dp_rank):
                self._next_global_row()
            yield row

    def state_dict(self) -> dict[str, Any]:
        return {
            "global": True,
            "epoch": self._epoch,
            "next": self._next,
            "row": self._row,
            "examples": len(self.examples),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("examples") != len(self.examples):
            raise ValueError(
                f"dataset state was saved for {state.get('examples')} examples, this data has "
                f"{len(self.examples)}; the data changed since the checkpoint"
            )
        self._epoch, self._next, self._row = state["epoch"], state["next"], state["row"]
        self._order = self._permutation(self._epoch)
