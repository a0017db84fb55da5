"""Reading and writing Hugging Face safetensors folders, single-file or sharded.

Reading is lazy: the index maps each tensor to its file, and a tensor (or a slice of
its first dimension) is read only when asked for, so a rank loads what it holds. A folder is
data from elsewhere, so opening one checks what it declares before anything is read: every
file the index names lies inside the folder (``temper.utils.paths.inside``), and every shard's
header parses and describes tensors that fit the file (known dtypes, offsets within the data,
each tensor's bytes its shape times its dtype's size). A tensor read with NaN or infinite
values is refused, naming it.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from temper.utils.paths import UnsafePath, inside

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 2**30
MAX_HEADER_BYTES = 100_000_000
"""The largest header the safetensors library itself reads (a bound on what a lying length
field can make us allocate)."""
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "C64": torch.complex64,
}
"""The safetensors dtypes a tensor is read as (what ``safetensors.torch`` maps)."""


class WeightError(ValueError):
    """A model folder's weights that cannot be loaded as they are: a malformed shard header,
    missing, mis-shaped, integer-typed or non-finite tensors. The message names the file (and
    the tensor)."""


class TensorInfo(NamedTuple):
    """One tensor of a shard's header."""

    dtype: torch.dtype
    shape: tuple[int, ...]


class SafetensorsFolder:
    """The tensors of an HF model folder, by name, without loading them."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        index = self.folder / INDEX_FILE
        if index.is_file():
            self._file_of = _weight_map(self.folder, inside(self.folder, INDEX_FILE))
        elif (self.folder / SINGLE_FILE).is_file():
            single = inside(self.folder, SINGLE_FILE)
            self._file_of = dict.fromkeys(read_header(single), single)
        else:
            raise FileNotFoundError(
                f"{self.folder}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors weights "
                "are read; convert .bin checkpoints first)"
            )
        missing_files = sorted({str(p) for p in self._file_of.values() if not p.is_file()})
        if missing_files:
            raise FileNotFoundError(f"{index}: shard files missing: {', '.join(missing_files)}")
        self._info = _shard_headers(index, self._file_of)

    def keys(self) -> list[str]:
        return sorted(self._file_of)

    def __contains__(self, key: str) -> bool:
        return key in self._file_of

    def shape(self, key: str) -> tuple[int, ...]:
        return self._info[key].shape

    def dtype(self, key: str) -> torch.dtype:
        return self._info[key].dtype

    def read(self, key: str, rows: slice | None = None) -> torch.Tensor:
        """The tensor `key`, or only `rows` of its first dimension; WeightError when it holds
        a NaN or an infinity."""
        with safe_open(self._file_of[key], "pt") as f:
            value = f.get_tensor(key) if rows is None else f.get_slice(key)[rows]
        check_finite(value, f"{self._file_of[key]}: tensor {key!r}")
        return value


def check_finite(value: torch.Tensor, what: str) -> None:
    """WeightError naming `what` when a floating tensor holds a NaN or an infinity."""
    if not value.is_floating_point():
        return
    # isfinite has no kernel for some one-byte floats; float32 holds all of their values.
    finite = torch.isfinite(value.float() if value.element_size() == 1 else value)
    if not finite.all():
        bad = int((~finite).sum())
        raise WeightError(f"{what} holds {bad} non-finite values (NaN or inf); refused")


def _weight_map(folder: Path, index: Path) -> dict[str, Path]:
    """Tensor name -> shard file of an index, each file confined to `folder`."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as err:
        raise WeightError(f"{index}: not a safetensors index ({err})") from None
    if not isinstance(weight_map, dict):
        raise WeightError(f"{index}: weight_map is not an object")
    file_of = {}
    for key, name in weight_map.items():
        if not isinstance(name, str):
            raise WeightError(f"{index}: weight_map[{key!r}] is not a file name: {name!r}")
        try:
            file_of[key] = inside(folder, name)
        except UnsafePath as err:
            raise UnsafePath(f"{index}: weight_map[{key!r}] = {name!r}: {err}") from None
    return file_of


def _shard_headers(index: Path, file_of: Mapping[str, Path]) -> dict[str, TensorInfo]:
    """Each tensor's header entry, every shard's header checked; the index's names must be in
    the shards it names."""
    headers = {path: read_header(path) for path in set(file_of.values())}
    info = {}
    for key, path in file_of.items():
        if key not in headers[path]:
            raise WeightError(f"{index}: maps {key!r} to {path.name}, whose header lacks it")
        info[key] = headers[path][key]
    return info


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors a safetensors file declares, after checking that its header fits the file
    (the safetensors library's own rules); WeightError naming the file and the tensor."""
    size = path.stat().st_size
    with path.open("rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise WeightError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (length,) = struct.unpack("<Q", prefix)
        if length > size - 8:
            raise WeightError(
                f"{path}: header length {length} runs past the end of the file ({size} bytes)"
            )
        if length > MAX_HEADER_BYTES:
            raise WeightError(f"{path}: header length {length} is over {MAX_HEADER_BYTES} bytes")
        raw = file.read(length)
    try:
        header = json.loads(raw)
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
        raise WeightError(f"{path}: header is not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise WeightError(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - length
    tensors = {name: _tensor_info(path, name, entry) for name, entry in header.items()}
    _check_layout(path, header, tensors, data_bytes)
    return tensors


def _tensor_info(path: Path, name: str, entry: Any) -> TensorInfo:
    what = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise WeightError(f"{what}: header entry is not an object")
    dtype = DTYPES.get(entry.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise WeightError(f"{what}: unknown dtype {entry.get('dtype')!r}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise WeightError(f"{what}: shape {shape!r} is not a list of sizes")
    return TensorInfo(dtype, tuple(shape))


def _check_layout(
    path: Path, header: dict[str, Any], tensors: Mapping[str, TensorInfo], data_bytes: int
) -> None:
    """The tensors tile the data exactly, in offset order, each as large as it declares."""
    spans = []
    for name, info in tensors.items():
        offsets = header[name].get("data_offsets")
        if not (
            isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
        ):
            raise WeightError(
                f"{path}: tensor {name!r}: data_offsets {offsets!r} is not [begin, end]"
            )
        begin, end = offsets
        if not 0 <= begin <= end <= data_bytes:
            raise WeightError(
                f"{path}: tensor {name!r}: data_offsets {offsets} lie outside the file's "
                f"{data_bytes} data bytes (truncated or mis-declared)"
            )
        expected = math.prod(info.shape) * info.dtype.itemsize
        if end - begin != expected:
            raise WeightError(
                f"{path}: tensor {name!r}: {end - begin} bytes declared, but shape "
                f"{list(info.shape)} of {header[name]['dtype']} takes {expected}"
            )
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise WeightError(f"{path}: tensor {name!r} starts at {begin}, expected {position}")
        position = end
    if position != data_bytes:
        raise WeightError(
            f"{path}: the tensors cover {position} of the file's {data_bytes} data bytes"
        )


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
