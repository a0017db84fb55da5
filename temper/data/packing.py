"""Packed rows with isolated documents: positions restart per document, no cross-document label.

A document is its tokens plus the EOS that closes it, so in a packed row a document ends
after each EOS, and a row's first token starts one (a document cut by the row boundary
continues as a new one: attention never reaches into the previous row anyway). Inside a
document the last real token predicts its EOS; the EOS would predict the next document's
first token, so its label is ignored. Both are pure functions of the row's tokens, so the
dataset's saved position is unchanged by isolation. ``DocumentMask.from_position_ids``
(``temper.kernels.attention``) turns these positions into what attention needs.
"""

from collections.abc import Callable
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
