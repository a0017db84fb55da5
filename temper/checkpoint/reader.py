"""Read a DCP checkpoint without executing anything it holds.

DCP's own reader unpickles `.metadata` with plain ``pickle.load``: a crafted file runs
whatever its ``__reduce__`` names. `CheckpointReader` reads it first, through an
unpickler that admits only the classes DCP's metadata is made of (its dataclasses, the
file reader's per-item record, ``torch.Size``, dtypes, layouts, paths), and refuses any
other global with an error naming the file, before DCP sees it.
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

from temper.utils.compat import dcp_memory_format, dcp_storage_info, layout_by_name

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
    """The DCP `Metadata` of a checkpoint folder, read without running any code it holds."""
    path = Path(folder) / DCP_METADATA_FILE
    try:
        with open(path, "rb") as file:
            metadata = _MetadataUnpickler(file, path).load()
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{path}: not found; {folder} is not a DCP checkpoint") from err
    except (
        pickle.UnpicklingError,
        EOFError,
        AttributeError,
        TypeError,
        KeyError,
        IndexError,
    ) as err:
        raise UnsafeCheckpoint(f"{path}: not a readable DCP metadata file ({err})") from err
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


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
