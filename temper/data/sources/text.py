"""Plain text: the documents of a ``.txt`` file (runs of lines between blank lines), and the
endless built-in synthetic stream."""

from __future__ import annotations

import mmap
from array import array
from pathlib import Path

from temper.data.sources.base import Record
from temper.data.synthetic import synthetic_document


class SyntheticSource:
    """The endless built-in task stream for one seed: ``{"text": document}``."""

    num_records: int | None = None
    fields = ("text",)

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.name = "builtin"

    def record(self, index: int) -> Record:
        return {"text": synthetic_document(self.seed, index)}

    def where(self, index: int) -> str:
        return f"builtin document {index}"


def _spans(data: mmap.mmap, path: Path) -> tuple[array, array, array]:
    """(start, end, first line) of each document: runs of non-blank lines."""
    starts, ends, lines = array("q"), array("q"), array("q")
    start: int | None = None
    end = offset = 0
    for lineno, line in enumerate(iter(data.readline, b""), start=1):
        text = line.rstrip(b"\n").removesuffix(b"\r")
        if text.strip():
            try:
                text.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{path}:{lineno}: not valid UTF-8") from None
            if start is None:
                start = offset
                lines.append(lineno)
            end = offset + len(text)
        elif start is not None:
            starts.append(start)
            ends.append(end)
            start = None
        offset += len(line)
    if start is not None:
        starts.append(start)
        ends.append(end)
    return starts, ends, lines


class TextFileSource:
    """The documents of a UTF-8 ``.txt`` file, each ``{text_field: document}``.

    Opening reads the file once to find the documents' byte spans (and checks UTF-8); a
    record is then one slice of the memory-mapped file.
    """

    def __init__(self, path: Path, text_field: str = "text") -> None:
        self.name = str(path)
        self.path = path
        self.text_field = text_field
        self.fields = (text_field,)
        empty = ValueError(f"{path}: no documents found (only blank lines or empty files)")
        if path.stat().st_size == 0:
            raise empty
        with path.open("rb") as file:
            self._data = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        self._starts, self._ends, self._lines = _spans(self._data, path)
        self.num_records: int | None = len(self._starts)
        if not self.num_records:
            raise empty

    def record(self, index: int) -> Record:
        raw = self._data[self._starts[index] : self._ends[index]]
        return {self.text_field: raw.decode("utf-8")}

    def where(self, index: int) -> str:
        return f"{self.path}:{self._lines[index]}"
