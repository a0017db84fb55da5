"""The stream: sources, read by lanes, through a format and its packer, into rows.

A run's rows come from ``lanes`` independent lanes, as many as the rows of one optimizer
step over all data-parallel ranks. Lane ``j`` reads positions ``j, j + lanes, j + 2 lanes,
...`` of each source's global order and packs them itself. The lanes are laid out as a
step's micro-batches: with ``b`` rows per micro-batch and rank, the ``m``-th global
micro-batch is lanes ``m * G`` to ``(m + 1) * G - 1`` (``G = b * dp_world``), of which rank
``r`` owns the ``b`` from ``m * G + r * b``; a rank yields one row of each of its lanes in
turn. So:

* Each rank reads, parses and tokenizes only its own documents: 1/dp of the stream.
* A step's global batch (every lane's next row) is the same at any data-parallel size and
  any gradient accumulation, and so is each global micro-batch, rows in order: the ranks'
  ``m``-th micro-batches, one after another, are a single process's ``m``-th micro-batch of
  ``G`` rows. So layouts train on the same data micro-batch by micro-batch (a loss that is
  not a sum over tokens, as MoE load balancing, sees the same rows together), and a rank's
  share of it is a slice of the single process's.
* The state is per lane (its counters and its packer's leftover tokens), never per rank:
  gathered from all ranks (``merge_states``), it resumes at any ``dp_world`` that divides
  ``lanes``, with no document repeated or skipped.

A source's global order is its records in file order (text), or a seeded permutation per
epoch (chat formats), epoch after epoch. With several sources, each draw of lane ``j`` picks
a source at random with probability proportional to its weight, from a generator seeded by
``(seed, j, draw)``: deterministic, resumable, and weighted over documents. Records the
format drops (over-long) use their position and are counted.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from temper.data.packing import LaneReader
from temper.data.sources import Record, Source
from temper.data.sources.base import RecordError, record_error


class Packer(Protocol):
    def row(self, reader: LaneReader) -> dict[str, torch.Tensor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Format(Protocol):
    """Records to samples (tokens) to rows: one module per format (text, sft, ...)."""

    required: tuple[tuple[str, ...], ...]
    """Fields a record must carry, each as the names any one of which will do, checked
    against a source's schema when it has one."""
    shuffle: bool
    """Whether a source is read in a seeded permutation per epoch rather than in order."""

    def encode(self, record: Record, where: str) -> tuple[Any, str | None]:
        """The sample (None if dropped) and what the length policy did ("truncated",
        "dropped" or None); a malformed record raises ValueError naming ``where``."""
        ...

    def tokens(self, sample: Any) -> int: ...

    def packer(self) -> Packer: ...


def check_fields(source: Source, fmt: Format) -> None:
    """Refuse a source whose schema lacks a field the format reads, before reading a row."""
    if source.fields is None:
        return
    missing = [names[0] for names in fmt.required if not set(names) & set(source.fields)]
    if missing:
        raise ValueError(
            f"{source.name}: no field {', '.join(map(repr, missing))} (it has "
            f"{', '.join(source.fields) or 'no fields'})"
        )


class Order:
    """Position -> record index of one source: epoch after epoch, shuffled or in order."""

    def __init__(self, num_records: int | None, shuffle: bool, seed: int) -> None:
        self.num_records = num_records
        self.shuffle = shuffle
        self.seed = seed
        self._permutations: dict[int, list[int]] = {}

    def __call__(self, position: int) -> int:
        if self.num_records is None:
            return position
        epoch, index = divmod(position, self.num_records)
        if not self.shuffle:
            return index
        if epoch not in self._permutations:
            if len(self._permutations) > 1:  # lanes straddle at most one epoch boundary
                del self._permutations[min(self._permutations)]
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._permutations[epoch] = torch.randperm(
                self.num_records, generator=generator
            ).tolist()
        return self._permutations[epoch][index]


class Lane:
    """One lane's reader: its counters (the state), the next sample read ahead, its packer."""

    def __init__(self, stream: LaneStream, index: int) -> None:
        self.stream = stream
        self.index = index
        self.draws = 0
        n = len(stream.sources)
        self.taken, self.tokens = [0] * n, [0] * n
        self.truncated = self.dropped = self.rows = 0
        self.packer = stream.format.packer()
        self._ahead: tuple[int, Any, str | None, int] | None = None

    def _source(self) -> int:
        weights = self.stream.weights
        if len(weights) == 1:
            return 0
        rng = random.Random(f"temper.mix:{self.stream.seed}:{self.index}:{self.draws}")
        return rng.choices(range(len(weights)), weights)[0]

    def peek(self) -> Any:
        dropped = 0
        while self._ahead is None:
            if dropped > self.stream.records_per_epoch:
                raise RecordError(
                    f"{', '.join(s.name for s in self.stream.sources)}: lane {self.index} drew "
                    f"{dropped} records in a row that the format dropped (over-long for the "
                    "sequence length, or nothing to train on)"
                )
            s = self._source()
            source, order = self.stream.sources[s], self.stream.orders[s]
            position = self.index + self.taken[s] * self.stream.lanes
            record = order(position)
            where = source.where(record)
            try:
                sample, outcome = self.stream.format.encode(source.record(record), where)
            except ValueError as error:
                raise record_error(error, where) from None
            if sample is None:
                self.draws += 1
                self.taken[s] += 1
                self.dropped += 1
                dropped += 1
                continue
            self._ahead = s, sample, outcome, position // (source.num_records or position + 1)
        return self._ahead[1]

    def epoch(self) -> int:
        """The epoch of its source the next sample comes from."""
        self.peek()
        return self._ahead[3]

    def take(self) -> Any:
        sample = self.peek()
        s, _, outcome, _ = self._ahead
        self._ahead = None
        self.draws += 1
        self.taken[s] += 1
        self.tokens[s] += self.stream.format.tokens(sample)
        self.truncated += outcome == "truncated"
        return sample

    def row(self) -> dict[str, torch.Tensor]:
        row = self.packer.row(self)
        self.rows += 1
        return row

    def state_dict(self) -> dict[str, Any]:
        return {
            "draws": self.draws,
            "taken": list(self.taken),
            "tokens": list(self.tokens),
            "truncated": self.truncated,
            "dropped": self.dropped,
            "rows": self.rows,
            "packer": self.packer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.draws, self.rows = state["draws"], state["rows"]
        self.taken, self.tokens = list(state["taken"]), list(state["tokens"])
        self.truncated, self.dropped = state["truncated"], state["dropped"]
        self.packer.load_state_dict(state["packer"])
        self._ahead = None


class LaneStream:
    """This rank's rows of ``sources`` (mixed by ``weights``) through ``format`` (see the
    module docstring). Iterating yields rows forever, one lane after another."""

    def __init__(
        self,
        sources: Sequence[Source],
        format: Format,
        *,
        weights: Sequence[float] | None = None,
        labels: Sequence[str] | None = None,
        lanes: int = 1,
        dp_rank: int = 0,
        dp_world: int = 1,
        micro_batch: int | None = None,
        seed: int = 0,
    ) -> None:
        """``micro_batch``: rows per micro-batch on one rank; None for one micro-batch a step
        (``lanes / dp_world``)."""
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"need 0 <= dp_rank < dp_world, got {dp_rank} and {dp_world}")
        if lanes < 1 or lanes % dp_world:
            raise ValueError(f"{lanes} lanes do not split over {dp_world} data-parallel ranks")
        micro_batch = micro_batch or lanes // dp_world
        if lanes % (micro_batch * dp_world):
            raise ValueError(
                f"{lanes} lanes do not make micro-batches of {micro_batch} rows on each of "
                f"{dp_world} data-parallel ranks"
            )
        weights = list(weights or [1.0] * len(sources))
        if len(weights) != len(sources) or not all(w > 0 for w in weights):
            raise ValueError(f"source weights must be positive, one per source; got {weights}")
        for source in sources:
            check_fields(source, format)
        self.sources = list(sources)
        self.format = format
        self.weights = weights
        self.labels = list(labels or [f"source{i}" for i in range(len(sources))])
        self.lanes = lanes
        self.seed = seed
        self.records_per_epoch = sum(s.num_records or 1 << 20 for s in sources)
        self.orders = [
            Order(s.num_records, format.shuffle, seed + 7919 * i) for i, s in enumerate(sources)
        ]
        group = micro_batch * dp_world  # lanes of one global micro-batch
        self._lanes = [
            Lane(self, start + dp_rank * micro_batch + i)
            for start in range(0, lanes, group)
            for i in range(micro_batch)
        ]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield min(self._lanes, key=lambda lane: lane.rows).row()

    @property
    def stats(self) -> dict[str, int]:
        """This rank's counts so far: samples truncated and dropped by the length policy, and
        each source's documents read and tokens produced."""
        lanes = self._lanes
        stats = {
            "truncated": sum(lane.truncated for lane in lanes),
            "dropped": sum(lane.dropped for lane in lanes),
        }
        for s, label in enumerate(self.labels):
            stats[f"{label}_documents"] = sum(lane.taken[s] for lane in lanes)
            stats[f"{label}_tokens"] = sum(lane.tokens[s] for lane in lanes)
        return stats

    def _signature(self) -> list[int]:
        return [s.num_records or 0 for s in self.sources]

    def state_dict(self) -> dict[str, Any]:
        """This rank's lanes; ``merge_states`` of every rank's is the whole stream's. Plain
        ints, lists and dicts (string keys) only."""
        return {
            "lanes": self.lanes,
            "records": self._signature(),
            "lane": {str(lane.index): lane.state_dict() for lane in self._lanes},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("lanes") != self.lanes:
            raise ValueError(
                f"the data state was saved with {state.get('lanes')} lanes (rows per optimizer "
                f"step), this run has {self.lanes}: keep training.global_batch_size as it was"
            )
        if state.get("records") != self._signature():
            raise ValueError(
                f"the data state was saved for sources of {state.get('records')} records "
                f"(0 = endless), these have {self._signature()}; the data changed since the "
                "checkpoint"
            )
        missing = [lane.index for lane in self._lanes if str(lane.index) not in state["lane"]]
        if missing:
            raise ValueError(f"the data state lacks lanes {missing}: gather every rank's state")
        for lane in self._lanes:
            lane.load_state_dict(state["lane"][str(lane.index)])


def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The whole stream's state from the ranks' ``state_dict``s (copies of a rank, as
    sequence-parallel peers hold, may repeat)."""
    merged = {**states[0], "lane": {}}
    for state in states:
        if state["lanes"] != merged["lanes"]:
            raise ValueError("the ranks' data states disagree on the number of lanes")
        merged["lane"].update(state["lane"])
    return merged
