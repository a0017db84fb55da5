"""Packed rows with isolated documents: positions restart per document, no cross-document label.

A document is its tokens plus the EOS that closes it, so in a packed row a document ends
after each EOS, and a row's first token starts one (a document cut by the row boundary
continues as a new one: attention never reaches into the previous row anyway). Inside a
document the last real token predicts its EOS; the EOS would predict the next document's
first token, so its label is ignored. Both are pure functions of the row's tokens, so the
dataset's saved position is unchanged by isolation. ``DocumentMask.from_position_ids``
(``temper.kernels.attention``) turns these positions into what attention needs.
"""

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from temper.data.batch import IGNORE_INDEX


def document_position_ids(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Positions [..., s] that count from 0 at the row start and after every EOS."""
    starts = F.pad(input_ids[..., :-1] == eos_id, (1, 0), value=True)
    index = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
    start_of_document = torch.where(starts, index, 0).cummax(dim=-1).values
    return index - start_of_document


def document_labels(input_ids: torch.Tensor, labels: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Next-token ``labels`` without the ones that cross a boundary: an EOS predicts nothing."""
    return labels.masked_fill(input_ids == eos_id, IGNORE_INDEX)


class LaneReader(Protocol):
    """The samples of one lane, in order, already encoded by the format."""

    def peek(self) -> Any:
        """The next sample, not consumed."""
        ...

    def take(self) -> Any:
        """The next sample, consumed."""
        ...


class TokenPacker:
    """A continuous token stream cut into rows of ``seq_len + 1`` tokens, consecutive rows
    sharing one token, so every token is predicted exactly once (``input_ids = row[:-1]``,
    ``labels = row[1:]``). The tokens of a document left over after a row wait in ``buffer``,
    which is the packer's state. ``isolate`` adds per-document ``position_ids`` and ignores the
    labels that cross a document boundary (see the module docstring)."""

    def __init__(self, seq_len: int, eos_id: int, isolate: bool) -> None:
        self.seq_len = seq_len
        self.eos_id = eos_id
        self.isolate = isolate
        self.buffer: list[int] = []

    def row(self, reader: LaneReader) -> dict[str, torch.Tensor]:
        while len(self.buffer) <= self.seq_len:
            self.buffer += reader.take()
        tokens = self.buffer[: self.seq_len + 1]
        del self.buffer[: self.seq_len]
        input_ids = torch.tensor(tokens[:-1], dtype=torch.long)
        labels = torch.tensor(tokens[1:], dtype=torch.long)
        if not self.isolate:
            return {"input_ids": input_ids, "labels": labels}
        return {
            "input_ids": input_ids,
            "labels": document_labels(input_ids, labels, self.eos_id),
            "position_ids": document_position_ids(input_ids, self.eos_id),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": list(self.buffer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer = list(state["buffer"])


class EpochReader(LaneReader, Protocol):
    def epoch(self) -> int:
        """The epoch of its source the next sample comes from."""
        ...


def fill_in_order(reader: EpochReader, width: Callable[[Any], int], room: int) -> list[Any]:
    """The next sample and, while the following one is of the same epoch and fits in what is
    left of ``room`` positions, that one too: whole samples in reading order (``room`` 0: one
    a row), a sample never beside its own next copy. Nothing waits between rows, so a packer
    built on it has no state."""
    epoch = reader.epoch()
    samples = [reader.take()]
    used = width(samples[0])
    while (
        (ahead := reader.peek()) is not None
        and reader.epoch() == epoch
        and used + width(ahead) <= room
    ):
        samples.append(reader.take())
        used += width(samples[-1])
    return samples


class RowPacker:
    """Rows built from the reader alone, with no state of their own: ``build`` takes the
    samples a row holds (one padded pair, one prompt, as many SFT samples as fit)."""

    def __init__(self, build: Callable[[LaneReader], dict[str, torch.Tensor]]) -> None:
        self.build = build

    def row(self, reader: LaneReader) -> dict[str, torch.Tensor]:
        return self.build(reader)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class BestFitPacker:
    """Whole samples into rows of ``seq_len`` positions, best-fit decreasing over a lookahead
    buffer: the buffer is topped up to ``buffer`` samples from the reader, a row opens with
    its longest sample and then takes, while any fits, the longest that fits the room left
    (the best fit: it leaves the least). No sample is split, so document isolation is the row
    builder's as before; ``buffer`` 1 is the old first-fit in reading order.

    A short sample could wait behind ever-better fits, so one that has waited ``buffer`` rows
    opens the next row instead: every sample is in a row within ``2 * buffer`` rows of being
    read. Ties go to the sample read first, so the rows are a function of the samples read,
    as the lanes need (deterministic at any data-parallel size). The buffered samples (tuples
    of plain lists) and the row count are the state: a resumed lane continues exactly."""

    def __init__(
        self,
        seq_len: int,
        buffer: int,
        width: Callable[[Any], int],
        build: Callable[[Sequence[Any]], dict[str, torch.Tensor]],
    ) -> None:
        """``width(sample)``: the positions the sample takes in a row (<= ``seq_len``);
        ``build(samples)``: the row holding ``samples`` in that order."""
        if buffer < 1:
            raise ValueError(f"the packing buffer holds at least one sample, got {buffer}")
        self.seq_len = seq_len
        self.buffer = buffer
        self.width = width
        self.build = build
        self.waiting: list[tuple[Any, int]] = []
        """(sample, the row count when it was read), in reading order."""
        self.rows = 0

    def row(self, reader: LaneReader) -> dict[str, torch.Tensor]:
        self._top_up(reader)
        if not self.waiting:
            raise ValueError("the reader ran out of samples")
        overdue = self.rows - self.waiting[0][1] >= self.buffer
        pick = 0 if overdue else self._longest(self.seq_len)
        chosen: list[Any] = []
        room = self.seq_len
        while pick is not None:
            chosen.append(self.waiting.pop(pick)[0])
            room -= self.width(chosen[-1])
            self._top_up(reader)
            pick = self._longest(room)
        self.rows += 1
        return self.build(chosen)

    def _top_up(self, reader: LaneReader) -> None:
        """Read until ``buffer`` samples wait (fewer where a finite reader ends)."""
        while len(self.waiting) < self.buffer and reader.peek() is not None:
            self.waiting.append((reader.take(), self.rows))

    def _longest(self, room: int) -> int | None:
        """Index of the longest waiting sample of at most ``room`` positions (the first read
        among equals), or None. A linear scan: a few per row, over a buffer of tens to
        thousands of samples, is cheap beside tokenizing them."""
        best, best_width = None, 0
        for i, (sample, _) in enumerate(self.waiting):
            width = self.width(sample)
            if best_width < width <= room:
                best, best_width = i, width
        return best

    def state_dict(self) -> dict[str, Any]:
        return {
            "waiting": [[list(part) for part in sample] + [read] for sample, read in self.waiting],
            "rows": self.rows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.waiting = [
            (tuple(list(part) for part in entry[:-1]), entry[-1]) for entry in state["waiting"]
        ]
        self.rows = state["rows"]
