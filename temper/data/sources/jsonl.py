"""JSON Lines, plain or gzipped: one JSON object per non-blank line.

Opening indexes the lines (a plain file is memory-mapped; a ``.jsonl.gz`` is decompressed
into memory once, since gzip has no random access: for a corpus larger than memory, use
parquet or a pretokenized shard). A record is parsed when it is read, so each rank parses
only its own; a malformed line fails naming its file and line, and a line longer than
``data.max_record_bytes`` fails as the file is indexed, before any of it is parsed.
"""

from __future__ import annotations

import gzip
import json
import mmap
import zlib
from array import array
from pathlib import Path

from temper.config import Data
from temper.data.sources.base import Record, RecordError


def _read(path: Path) -> bytes | mmap.mmap:
    if path.name.endswith(".gz"):
        try:
            return gzip.decompress(path.read_bytes())
        except (OSError, EOFError, zlib.error) as error:
            raise ValueError(f"{path}: not a readable gzip file ({error})") from None
    if path.stat().st_size == 0:
        return b""
    with path.open("rb") as file:
        return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)


def record_too_long(max_bytes: int) -> str:
    return f"the record is longer than data.max_record_bytes ({max_bytes} bytes); refused"


def parse_line(line: bytes, where: str) -> Record:
    try:
        record = json.loads(line)
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise RecordError(f"{where}: invalid JSON ({error})") from None
    if not isinstance(record, dict):
        raise RecordError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


class JsonlSource:
    """The records of one ``.jsonl`` or ``.jsonl.gz`` file."""

    fields = None

    def __init__(self, path: Path, max_record_bytes: int = Data.max_record_bytes) -> None:
        self.name = str(path)
        self.path = path
        self._data = _read(path)
        self._starts, self._ends, self._lines = array("q"), array("q"), array("q")
        offset = 0
        end = len(self._data)
        lineno = 0
        while offset < end:
            lineno += 1
            stop = self._data.find(b"\n", offset)
            stop = end if stop == -1 else stop
            if stop - offset > max_record_bytes:
                raise RecordError(f"{path}:{lineno}: {record_too_long(max_record_bytes)}")
            if self._data[offset:stop].strip():
                self._starts.append(offset)
                self._ends.append(stop)
                self._lines.append(lineno)
            offset = stop + 1
        self.num_records: int | None = len(self._starts)
        if not self.num_records:
            raise ValueError(f"{path}: no records (empty source)")

    def record(self, index: int) -> Record:
        return parse_line(self._data[self._starts[index] : self._ends[index]], self.where(index))

    def where(self, index: int) -> str:
        return f"{self.path}:{self._lines[index]}"
