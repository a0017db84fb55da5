"""Record sources: random access to record ``i`` of a file, a folder, the built-in tasks or a
list. A record is a dict of fields; a format (``temper.data.formats``) turns it into tokens.

Random access is what lets each data-parallel rank read only its own positions and what makes
resumption O(1): a stream's state names positions, never an open file. ``open_source`` picks
the reader by what the path is; a new kind of file is one module here and one line there.
"""

from __future__ import annotations

from pathlib import Path

from temper.config import Data
from temper.data.sources.arrow import ArrowSource, ParquetSource, is_arrow_folder
from temper.data.sources.base import (
    ConcatSource,
    ListSource,
    Record,
    RenamedSource,
    SliceSource,
    Source,
)
from temper.data.sources.jsonl import JsonlSource
from temper.data.sources.text import SyntheticSource, TextFileSource
from temper.data.sources.tokens import TOKEN_SUFFIX, TokenSource

_READERS = {
    ".txt": TextFileSource,
    ".jsonl": JsonlSource,
    ".jsonl.gz": JsonlSource,
    ".parquet": ParquetSource,
    TOKEN_SUFFIX: TokenSource,
}
SUFFIXES = tuple(_READERS)

__all__ = [
    "SUFFIXES",
    "ConcatSource",
    "ListSource",
    "Record",
    "RenamedSource",
    "SliceSource",
    "Source",
    "SyntheticSource",
    "open_source",
]


def _suffix(path: Path) -> str | None:
    return next((s for s in _READERS if path.name.endswith(s)), None)


def _open_file(
    path: Path, text_field: str, vocab_size: int | None, max_record_bytes: int
) -> Source:
    suffix = _suffix(path)
    if suffix is None:
        raise ValueError(f"{path}: unsupported file type; expected {', '.join(SUFFIXES)}")
    if suffix == ".txt":
        return TextFileSource(path, text_field)
    if suffix == TOKEN_SUFFIX:
        return TokenSource(path, vocab_size)
    if suffix == ".parquet":
        return ParquetSource(path)
    return JsonlSource(path, max_record_bytes)


def open_source(
    path: str,
    text_field: str = "text",
    vocab_size: int | None = None,
    max_record_bytes: int = Data.max_record_bytes,
) -> Source:
    """The records of ``path``: a file of a known kind, an Arrow dataset folder
    (``save_to_disk``), or a folder whose data files are read in sorted path order (a
    folder of parquet shards is one dataset). A ``.txt`` document is stored under
    ``text_field``; a token file's ids are checked to be below ``vocab_size``; a JSONL line
    longer than ``max_record_bytes`` is refused."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"{root}: no such file or folder")
    if root.is_file():
        return _open_file(root, text_field, vocab_size, max_record_bytes)
    if (root / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in root.iterdir() if p.is_dir())
        raise ValueError(f"{root}: a dataset with splits; name one: {', '.join(splits)}")
    if is_arrow_folder(root):
        return ArrowSource(root)
    files = sorted(
        (p for p in root.rglob("*") if p.is_file() and _suffix(p) is not None),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if not files:
        raise ValueError(f"{root}: no {', '.join(SUFFIXES)} files in this folder")
    sources = [_open_file(file, text_field, vocab_size, max_record_bytes) for file in files]
    return sources[0] if len(sources) == 1 else ConcatSource(sources, str(root))
