"""Reading and writing Hugging Face safetensors folders, single-file or sharded.

Reading is lazy: the index maps each tensor to its file, and a tensor (or a slice of
its first dimension) is read only when asked for, so a rank loads what it holds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 2**30


class SafetensorsFolder:
    """The tensors of an HF model folder, by name, without loading them."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        index = self.folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as err:
                raise ValueError(f"{index}: not a safetensors index ({err})") from err
            self._file_of = {key: self.folder / name for key, name in weight_map.items()}
        elif (self.folder / SINGLE_FILE).is_file():
            with safe_open(self.folder / SINGLE_FILE, "pt") as f:
                self._file_of = {key: self.folder / SINGLE_FILE for key in f.keys()}  # noqa: SIM118
        else:
            raise FileNotFoundError(
                f"{self.folder}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors weights "
                "are read; convert .bin checkpoints first)"
            )
        missing_files = sorted({str(p) for p in self._file_of.values() if not p.is_file()})
        if missing_files:
            raise FileNotFoundError(f"{index}: shard files missing: {', '.join(missing_files)}")

    def keys(self) -> list[str]:
        return sorted(self._file_of)

    def __contains__(self, key: str) -> bool:
        return key in self._file_of

    def shape(self, key: str) -> tuple[int, ...]:
        with safe_open(self._file_of[key], "pt") as f:
            return tuple(f.get_slice(key).get_shape())

    def read(self, key: str, rows: slice | None = None) -> torch.Tensor:
        """The tensor `key`, or only `rows` of its first dimension."""
        with safe_open(self._file_of[key], "pt") as f:
            if rows is None:
                return f.get_tensor(key)
            return f.get_slice(key)[rows]


def write_safetensors(
    folder: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> list[Path]:
    """Write `tensors` as one file, or as shards with an index when they exceed the limit."""
    return write_safetensors_streaming(folder, tensors, iter(tensors.items()), max_shard_bytes)


def write_safetensors_streaming(
    folder: str | os.PathLike[str],
    planned: Mapping[str, torch.Tensor],
    tensors: Iterator[tuple[str, torch.Tensor]],
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> list[Path]:
    """`write_safetensors` of tensors that arrive one at a time: `planned` (names, shapes and
    dtypes, in order; meta tensors will do) fixes the shards, and each shard is written and
    dropped as soon as `tensors` has yielded all of its own, so at most one shard (and what
    the iterator holds) is in memory. The files are those `write_safetensors` writes."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards = [list(shard) for shard in _split_into_shards(planned, max_shard_bytes)]
    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    arrived: dict[str, torch.Tensor] = {}
    for name, keys in zip(names, shards, strict=True):
        for key, tensor in tensors:
            arrived[key] = tensor
            if all(k in arrived for k in keys):
                break
        missing = [k for k in keys if k not in arrived]
        if missing:
            raise ValueError(f"{folder / name}: tensors never produced: {describe(missing)}")
        shard = {k: arrived.pop(k).detach().to("cpu").contiguous() for k in keys}
        save_safetensors(shard, folder / name)
        del shard
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(_nbytes(t) for t in planned.values())},
            "weight_map": {
                key: name for name, keys in zip(names, shards, strict=True) for key in keys
            },
        }
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [folder / name for name in names]


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    """One safetensors file, with the mode the umask gives every other file: safetensors
    itself creates it 0600, which left an exported folder half readable."""
    save_file(dict(tensors), path, metadata={"format": "pt"})
    mask = os.umask(0)
    os.umask(mask)
    path.chmod(0o666 & ~mask)


def _split_into_shards(
    tensors: Mapping[str, torch.Tensor], max_shard_bytes: int
) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        if shards[-1] and size + _nbytes(tensor) > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += _nbytes(tensor)
    return shards


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def read_json(path: Path, what: str) -> dict:
    """A JSON object from `path`, with an error that names the file."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{path}: {what} not found") from err
    except ValueError as err:
        raise ValueError(f"{path}: invalid JSON ({err})") from err
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return value


def describe(keys: Iterable[str], limit: int = 20) -> str:
    keys = list(keys)
    shown = ", ".join(keys[:limit])
    return shown + (f" ... and {len(keys) - limit} more" if len(keys) > limit else "")
