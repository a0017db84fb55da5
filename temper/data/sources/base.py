"""What every source offers, and the sources built from others (a list, a slice, a folder)."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate
from typing import Any, Protocol

Record = dict[str, Any]
"""One record: a document ``{"text": ...}``, a chat sample ``{"messages": [...]}``, a token
document ``{"input_ids": tensor}``, ... whatever fields the file holds."""


class Source(Protocol):
    name: str
    """The path (or a name) that errors and per-source metrics use."""
    num_records: int | None
    """Records per epoch; None for an endless stream."""
    fields: tuple[str, ...] | None
    """The fields every record has, when the file declares them (a parquet or Arrow schema);
    None when only the records know (JSONL)."""

    def record(self, index: int) -> Record: ...

    def where(self, index: int) -> str:
        """Where record ``index`` lives, for an error message: ``file:line``, ``file row N``."""
        ...


class RecordError(ValueError):
    """A data record is malformed; the message names the file, the line and the problem."""


def record_error(error: ValueError, where: str) -> RecordError:
    """``error`` met while reading the record at ``where``, as a RecordError that names
    ``where`` once: what a run that meets a bad record past the pre-flight's sample stops on
    (``temper: data error: ...``, exit code 2)."""
    message = str(error)
    return RecordError(message if message.startswith(where) else f"{where}: {message}")


def check_not_empty(source: Source) -> Source:
    if source.num_records == 0:
        raise ValueError(f"{source.name}: no records (empty source)")
    return source


class ListSource:
    """Records held in memory (the built-in tasks, a test's records)."""

    fields = None

    def __init__(self, records: Sequence[Record], name: str) -> None:
        self.records = records
        self.name = name
        self.num_records: int | None = len(records)
        check_not_empty(self)

    def record(self, index: int) -> Record:
        return self.records[index]

    def where(self, index: int) -> str:
        return f"{self.name} record {index}"


class ConcatSource:
    """Several sources one after the other (the files of a folder)."""

    def __init__(self, sources: Sequence[Source], name: str) -> None:
        self.sources = list(sources)
        self.name = name
        self._starts = [0, *accumulate(s.num_records or 0 for s in self.sources)]
        self.num_records: int | None = self._starts[-1]
        kinds = {s.fields for s in self.sources}
        self.fields = kinds.pop() if len(kinds) == 1 else None

    def _locate(self, index: int) -> tuple[Source, int]:
        i = bisect_right(self._starts, index) - 1
        return self.sources[i], index - self._starts[i]

    def record(self, index: int) -> Record:
        source, local = self._locate(index)
        return source.record(local)

    def where(self, index: int) -> str:
        source, local = self._locate(index)
        return source.where(local)


class SliceSource:
    """Records ``[start, stop)`` of ``source``: a training part and its held-out part."""

    def __init__(self, source: Source, start: int, stop: int, name: str) -> None:
        self.source = source
        self.start = start
        self.name = name
        self.fields = source.fields
        self.num_records: int | None = stop - start
        check_not_empty(self)

    def record(self, index: int) -> Record:
        return self.source.record(self.start + index)

    def where(self, index: int) -> str:
        return self.source.where(self.start + index)


class RenamedSource:
    """``source`` with some fields under the names a format reads: ``rename`` maps the
    format's name to the source's (``{"messages": "conversations"}``)."""

    def __init__(self, source: Source, rename: dict[str, str]) -> None:
        self.source = source
        self.name = source.name
        self.num_records = source.num_records
        self._pairs = list(rename.items())
        inverse = {column: name for name, column in self._pairs}
        self.fields = (
            None if source.fields is None else tuple(inverse.get(f, f) for f in source.fields)
        )

    def record(self, index: int) -> Record:
        record = dict(self.source.record(index))
        for name, column in self._pairs:
            if column in record:
                record[name] = record.pop(column)
        return record

    def where(self, index: int) -> str:
        return self.source.where(index)
