"""Read a DCP checkpoint without executing anything it holds or reading outside its folder.

DCP's own reader unpickles `.metadata` with plain ``pickle.load``, and its default load
planner reads every *bytes* entry with ``torch.load(weights_only=False)``: a crafted
checkpoint runs whatever a ``__reduce__`` names. `read_dcp_metadata` reads `.metadata`
through an unpickler that admits only the classes DCP's metadata is made of (its
dataclasses, the file reader's per-item record, ``torch.Size``, dtypes, layouts, paths),
then refuses any bytes entry (Temper keeps every non-tensor value in JSON, so it writes
none) and any storage path that is absolute, climbs out with ``..`` or is a symlink. What
is left for DCP to read is tensors, which it loads with ``weights_only=True``.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from temper.checkpoint.integrity import IncompleteCheckpoint
from temper.utils.compat import dcp_memory_format, dcp_storage_info, layout_by_name
from temper.utils.paths import UnsafePath, inside

DCP_METADATA_FILE = ".metadata"

_ADMITTED: tuple[object, ...] = (
    Metadata,
    MetadataIndex,
    StorageMeta,
    ChunkStorageMetadata,
    TensorStorageMetadata,
    BytesStorageMetadata,
    TensorProperties,
    dcp_memory_format,
    dcp_storage_info,
    torch.Size,
    layout_by_name,
    pathlib.PurePosixPath,
    pathlib.PosixPath,
    OrderedDict,
)
"""Every global a DCP ``.metadata`` may name (besides dtypes, which pickle as globals of
``torch``): DCP's dataclasses, its file reader's record, and the values they hold."""

_MODULES = frozenset({obj.__module__ for obj in _ADMITTED} | {"torch", "collections", "pathlib"})
"""The only modules a global is looked up in, so no other module is ever imported."""


class UnsafeCheckpoint(ValueError):
    """A checkpoint file that would run code, or cannot be read as what it claims to be."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        found = None
        if module in _MODULES:
            found = getattr(importlib.import_module(module), name, None)
        if any(found is obj for obj in _ADMITTED) or isinstance(found, torch.dtype):
            return found
        raise UnsafeCheckpoint(
            f"{self.path}: refused to load {module}.{name}; DCP metadata holds only DCP's "
            "metadata classes, so this file was not written by a checkpoint save (or was "
            "altered since): nothing in it was run"
        )


def read_dcp_metadata(folder: str | os.PathLike[str]) -> Metadata:
    """The DCP `Metadata` of a checkpoint folder, read without running any code it holds.

    Raises UnsafeCheckpoint for what a save never writes (a global outside DCP's metadata
    classes, a bytes entry, a storage path leading out of the folder) and
    IncompleteCheckpoint for a file that does not parse (damage: resume falls back).
    """
    path = Path(folder) / DCP_METADATA_FILE
    try:
        with open(path, "rb") as file:
            metadata = _MetadataUnpickler(file, path).load()
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{path}: not found; {folder} is not a DCP checkpoint") from err
    except UnsafeCheckpoint:
        raise
    except Exception as err:  # noqa: BLE001  (a damaged pickle fails in any way, MemoryError too)
        raise IncompleteCheckpoint(
            f"{path}: not a readable DCP metadata file ({type(err).__name__}: {err})"
        ) from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
    _check_entries(metadata, Path(folder), path)
    return metadata


def _check_entries(metadata: Metadata, folder: Path, path: Path) -> None:
    """Refuse bytes entries (DCP would unpickle them with code) and storage paths that are
    not plain files inside `folder`."""
    for name, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise UnsafeCheckpoint(
                f"{path}: entry {name!r} is a {type(entry).__name__} (a pickled object DCP "
                "would load with code); Temper checkpoints hold tensors only: refused, "
                "nothing in it was run"
            )
    for index, info in (metadata.storage_data or {}).items():
        try:
            inside(folder, str(info.relative_path), links=False)
        except UnsafePath as err:
            raise UnsafeCheckpoint(f"{path}: entry {index.fqn!r}: {err}") from None


class CheckpointReader(FileSystemReader):
    """DCP's file-system reader with `.metadata` read by the restricted unpickler, at
    construction: a refusal is a clear error of its own, not one folded into DCP's."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        super().__init__(folder)
        self._metadata = read_dcp_metadata(folder)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._metadata
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
