"""Parquet files and Arrow dataset folders (what ``datasets``' ``save_to_disk`` writes), read
with pyarrow: the columnar formats Hugging Face datasets are stored in.

Both declare their schema, so a missing field is refused when the source opens, before any
row is read. Parquet is read a row group at a time (the last one read is kept); an Arrow
folder's files are memory-mapped, so a record costs a slice, not a read of the file.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from itertools import accumulate
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from temper.data.sources.base import Record


def is_arrow_folder(folder: Path) -> bool:
    """A ``save_to_disk`` folder: ``state.json`` beside its ``.arrow`` files."""
    return (folder / "state.json").is_file() and any(folder.glob("*.arrow"))


class ParquetSource:
    """The rows of one ``.parquet`` file, each a dict of its columns."""

    def __init__(self, path: Path) -> None:
        self.name = str(path)
        self.path = path
        try:
            self._file = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as error:
            raise ValueError(f"{path}: not a readable parquet file ({error})") from None
        metadata = self._file.metadata
        self.fields = tuple(self._file.schema_arrow.names)
        sizes = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
        self._starts = [0, *accumulate(sizes)]
        self.num_records: int | None = self._starts[-1]
        if not self.num_records:
            raise ValueError(f"{path}: no records (empty source)")
        self._group, self._table = -1, pa.table({})

    def record(self, index: int) -> Record:
        group = bisect_right(self._starts, index) - 1
        if group != self._group:
            try:
                self._table = self._file.read_row_group(group)
            except (pa.ArrowException, OSError) as error:
                raise ValueError(f"{self.path} row group {group}: unreadable ({error})") from None
            self._group = group
        return self._table.slice(index - self._starts[group], 1).to_pylist()[0]

    def where(self, index: int) -> str:
        return f"{self.path} row {index}"


def _read_arrow(path: Path) -> pa.Table:
    source = pa.memory_map(str(path))
    try:
        return pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:
        try:
            return pa.ipc.open_file(source).read_all()
        except pa.ArrowInvalid as error:
            raise ValueError(f"{path}: not a readable Arrow file ({error})") from None


class ArrowSource:
    """The rows of a ``save_to_disk`` folder: its ``.arrow`` files in ``state.json``'s order."""

    def __init__(self, folder: Path) -> None:
        self.name = str(folder)
        state = json.loads((folder / "state.json").read_text())
        names = [f["filename"] for f in state.get("_data_files", [])]
        self._paths = [folder / n for n in names] or sorted(folder.glob("*.arrow"))
        self._tables = [_read_arrow(p) for p in self._paths]
        schemas = {tuple(t.schema.names) for t in self._tables}
        if len(schemas) != 1:
            raise ValueError(f"{folder}: its .arrow files have different columns: {schemas}")
        self.fields = schemas.pop()
        self._starts = [0, *accumulate(t.num_rows for t in self._tables)]
        self.num_records: int | None = self._starts[-1]
        if not self.num_records:
            raise ValueError(f"{folder}: no records (empty source)")

    def record(self, index: int) -> Record:
        i = bisect_right(self._starts, index) - 1
        return self._tables[i].slice(index - self._starts[i], 1).to_pylist()[0]

    def where(self, index: int) -> str:
        return f"{self.name} row {index}"
