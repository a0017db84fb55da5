"""Document sources: random access to document ``i`` of the synthetic stream or of text files.

Random access is what makes data resumption O(1): a dataset's state names a document
index, never an open file position.
"""

import json
from array import array
from pathlib import Path
from typing import Protocol

from temper.data.synthetic import synthetic_document

SUFFIXES = (".txt", ".jsonl")


class DocumentSource(Protocol):
    num_documents: int | None
    """Documents per epoch; None for an endless stream."""

    def document(self, index: int) -> str: ...


class SyntheticSource:
    """The endless built-in task stream for one seed."""

    num_documents: int | None = None

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def document(self, index: int) -> str:
        return synthetic_document(self.seed, index)


def _jsonl_text(line: bytes, path: Path, lineno: int, text_field: str) -> str:
    try:
        record = json.loads(line)
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"{path}:{lineno}: invalid JSON ({error})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
    if text_field not in record:
        raise ValueError(f"{path}:{lineno}: record has no field {text_field!r}")
    text = record[text_field]
    if not isinstance(text, str):
        raise ValueError(
            f"{path}:{lineno}: field {text_field!r} is {type(text).__name__}, expected a string"
        )
    return text


def _scan_jsonl(path: Path, text_field: str) -> list[tuple[int, int, int]]:
    """(start, end, line) of the non-blank lines, each checked to hold a string ``text_field``."""
    spans = []
    offset = 0
    with path.open("rb") as file:
        for lineno, line in enumerate(file, start=1):
            if line.strip():
                _jsonl_text(line, path, lineno, text_field)
                spans.append((offset, offset + len(line), lineno))
            offset += len(line)
    return spans


def _scan_txt(path: Path) -> list[tuple[int, int, int]]:
    """(start, end, first line) of the documents: runs of lines between blank lines."""
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        lineno = data.count(b"\n", 0, error.start) + 1
        raise ValueError(f"{path}:{lineno}: not valid UTF-8") from None
    spans = []
    start: int | None = None
    end = offset = first_line = 0
    for lineno, line in enumerate(data.split(b"\n"), start=1):
        if line.strip():
            if start is None:
                start, first_line = offset, lineno
            end = offset + len(line.removesuffix(b"\r"))
        elif start is not None:
            spans.append((start, end, first_line))
            start = None
        offset += len(line) + 1
    if start is not None:
        spans.append((start, end, first_line))
    return spans


def _list_files(root: Path) -> list[Path]:
    if not root.exists():
        raise FileNotFoundError(f"data path not found: {root}")
    if root.is_dir():
        files = sorted(
            (p for p in root.rglob("*") if p.is_file() and p.suffix in SUFFIXES),
            key=lambda p: p.relative_to(root).as_posix(),
        )
        if not files:
            raise ValueError(f"{root}: no {' or '.join(SUFFIXES)} files in this folder")
        return files
    if root.suffix not in SUFFIXES:
        raise ValueError(f"{root}: unsupported file type; expected {' or '.join(SUFFIXES)}")
    return [root]


def check_documents(path: str, text_field: str, limit: int) -> None:
    """Raise naming file and line unless ``path`` holds .txt/.jsonl files whose first
    ``limit`` lines parse (JSONL records with a string ``text_field``; UTF-8 text): the
    pre-flight check, cheap on a large corpus."""
    for file in _list_files(Path(path)):
        with file.open("rb") as handle:
            for lineno, line in enumerate(handle, start=1):
                if lineno > limit:
                    break
                if file.suffix == ".txt":
                    try:
                        line.decode("utf-8")
                    except UnicodeDecodeError:
                        raise ValueError(f"{file}:{lineno}: not valid UTF-8") from None
                elif line.strip():
                    _jsonl_text(line, file, lineno, text_field)


class FileSource:
    """Documents of a ``.txt``/``.jsonl`` file or a folder of them, in sorted path order.

    The constructor reads every file once: it validates all records up front (errors name
    file and line) and keeps each document's byte span, so ``document(i)`` is one seek.
    """

    def __init__(self, path: str, text_field: str = "text") -> None:
        self.text_field = text_field
        self.files = _list_files(Path(path))
        self._file_index = array("q")
        self._starts = array("q")
        self._ends = array("q")
        self._lines = array("q")
        for file_index, file in enumerate(self.files):
            spans = _scan_jsonl(file, text_field) if file.suffix == ".jsonl" else _scan_txt(file)
            for start, end, lineno in spans:
                self._file_index.append(file_index)
                self._starts.append(start)
                self._ends.append(end)
                self._lines.append(lineno)
        self.num_documents: int | None = len(self._starts)
        if not self.num_documents:
            raise ValueError(f"{path}: no documents found (only blank lines or empty files)")

    def document(self, index: int) -> str:
        file = self.files[self._file_index[index]]
        start = self._starts[index]
        with file.open("rb") as handle:
            handle.seek(start)
            raw = handle.read(self._ends[index] - start)
        if file.suffix == ".jsonl":
            return _jsonl_text(raw, file, self._lines[index], self.text_field)
        return raw.decode("utf-8")
