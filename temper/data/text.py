"""The pretraining stream: documents packed into fixed-length rows, sharded over DP ranks."""

from collections.abc import Iterator

import torch

from temper.data.packing import document_labels, document_position_ids
from temper.data.sources import DocumentSource, FileSource, SyntheticSource
from temper.data.tokenizer import Tokenizer

_STATE_KEYS = ("epoch", "document", "buffer", "row", "documents_per_epoch")


class TextDataset:
    """Endless rows of ``seq_len`` packed tokens with next-token labels.

    Packing: each document is tokenized and followed by EOS; the concatenation is cut into
    rows of ``seq_len + 1`` tokens, consecutive rows sharing one token, so global row ``g``
    holds stream tokens ``[g * seq_len, (g + 1) * seq_len]`` and every token is predicted
    exactly once. ``input_ids = row[:-1]``, ``labels = row[1:]``. File sources loop over
    epochs in the same order; ``seed`` only picks the synthetic stream.

    Isolation: with ``isolate_documents`` the rows are the same, but each also carries
    ``position_ids`` that restart at every document and an EOS's label (the next
    document's first token) is ignored, so with block-causal attention every document
    trains as if alone (``temper.data.packing``). Without it the stream is continuous:
    attention and labels run across documents, as in classic pretraining.

    Sharding: every rank builds the same global row stream. A step of the group consumes
    ``dp_world`` consecutive global rows starting at the group's row counter ``B``; rank
    ``r`` yields row ``B + r`` (from a fresh start: rows ``r, r + dp_world, ...``).

    Resumption: after yielding a row, a rank has already advanced past the rows of the
    other ranks in that step, so all ranks that yielded the same number of rows hold the
    same state: the next global row, the source position and the leftover tokens. Loading
    that state at any ``dp_world`` continues with global row ``B``: no row is seen twice or
    skipped. The dataset is a single stream: iterators share its position.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        seq_len: int,
        *,
        path: str | None = None,
        text_field: str = "text",
        seed: int = 0,
        dp_rank: int = 0,
        dp_world: int = 1,
        isolate_documents: bool = False,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"need 0 <= dp_rank < dp_world, got {dp_rank} and {dp_world}")
        self.tokenizer = tokenizer
        self.stats: dict[str, int] = {}  # a text stream neither truncates nor drops
        self.seq_len = seq_len
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.isolate_documents = isolate_documents
        self.source: DocumentSource = (
            SyntheticSource(seed) if path is None else FileSource(path, text_field)
        )
        self._epoch = 0
        self._document = 0
        self._buffer: list[int] = []
        self._row = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            self._skip_rows(self.dp_rank)
            row = self._next_global_row()
            self._skip_rows(self.dp_world - 1 - self.dp_rank)
            input_ids = torch.tensor(row[:-1], dtype=torch.long)
            sample = {"input_ids": input_ids, "labels": torch.tensor(row[1:], dtype=torch.long)}
            if self.isolate_documents:
                eos_id = self.tokenizer.eos_id
                sample["labels"] = document_labels(input_ids, sample["labels"], eos_id)
                sample["position_ids"] = document_position_ids(input_ids, eos_id)
            yield sample

    def _skip_rows(self, count: int) -> None:
        for _ in range(count):
            self._next_global_row()

    def _next_global_row(self) -> list[int]:
        while len(self._buffer) <= self.seq_len:
            self._buffer += self.tokenizer.encode(self.source.document(self._document))
            self._buffer.append(self.tokenizer.eos_id)
            self._document += 1
            if self._document == self.source.num_documents:
                self._document = 0
                self._epoch += 1
        row = self._buffer[: self.seq_len + 1]
        del self._buffer[: self.seq_len]
        self._row += 1
        return row

    def _documents_per_epoch(self) -> int:
        return self.source.num_documents or 0

    def state_dict(self) -> dict:
        """Position of the group's next global row; plain ints and lists only.

        ``documents_per_epoch`` is 0 for the endless synthetic stream.
        """
        return {
            "epoch": self._epoch,
            "document": self._document,
            "buffer": list(self._buffer),
            "row": self._row,
            "documents_per_epoch": self._documents_per_epoch(),
        }

    def load_state_dict(self, state: dict) -> None:
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"dataset state lacks {missing}; it holds {sorted(state)}")
        if state["documents_per_epoch"] != self._documents_per_epoch():
            raise ValueError(
                f"dataset state was saved for a source with {state['documents_per_epoch']} "
                f"documents per epoch (0 = synthetic), this one has "
                f"{self._documents_per_epoch()}; the data changed since the checkpoint"
            )
        self._epoch = state["epoch"]
        self._document = state["document"]
        self._buffer = list(state["buffer"])
        self._row = state["row"]
