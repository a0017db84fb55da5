"""`manifest.json`: every file a checkpoint holds, its size and digest, checked at load.

Written last into the partial folder, just before the rename that publishes it, so it
lists exactly what the save wrote. At load every listed file is read back and hashed
(streamed, one buffer a thread), so a flipped byte, a truncated or replaced shard, a lost
file, an unlisted file or a symlink is named, and `resume auto` falls back to the previous
checkpoint. The digest is SHA-256 over the SHA-256s of the file's 64 MiB pieces: the pieces
hash on a thread per core (hashlib lets go of the GIL), where one SHA-256 of a whole shard
runs on one core at about 1 GB/s, as slow as writing it. A digest guards against damage,
not against someone who rewrites the manifest too: what keeps a crafted checkpoint from
running code or reading outside its folder is `reader.py`, which every load goes through.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch.distributed as dist

from temper.utils.paths import files_inside, inside

MANIFEST_FILE = "manifest.json"
_READ = 1 << 20
PIECE = 64 << 20
DIGEST = "sha256 of the sha256 of each 64 MiB piece"
"""The manifest's name for its digest, so a later scheme is never compared with this one."""
_THREADS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


class IncompleteCheckpoint(ValueError):
    """A checkpoint folder whose files differ from what its save wrote: lost, truncated,
    altered or added since. `resume auto` passes over it to the checkpoint before."""


def sha256_of(path: Path) -> str:
    """The file's plain SHA-256 (what ``sha256sum`` prints), read 1 MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_READ):
            digest.update(chunk)
    return digest.hexdigest()


def digest_of(path: Path) -> str:
    """SHA-256 of the concatenated SHA-256s of the file's 64 MiB pieces, the pieces hashed
    in parallel (memory: 1 MiB a thread)."""
    pieces = range(0, max(path.stat().st_size, 1), PIECE)
    with ThreadPoolExecutor(_THREADS) as pool:
        hashes = pool.map(lambda offset: _piece_sha256(path, offset), pieces)
        return hashlib.sha256(b"".join(hashes)).hexdigest()


def _piece_sha256(path: Path, offset: int) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        file.seek(offset)
        left = PIECE
        while left and (chunk := file.read(min(_READ, left))):
            digest.update(chunk)
            left -= len(chunk)
    return digest.digest()


def listed_files(folder: Path) -> list[str]:
    """Every file of a save's folder by relative path (the manifest excepted), refusing a
    symlink: Temper writes none."""
    return [
        path.relative_to(folder).as_posix()
        for path in files_inside(folder, links=False)
        if path.name != MANIFEST_FILE
    ]


def file_records(folder: Path, names: Sequence[str]) -> dict[str, dict[str, int | str]]:
    """Size and SHA-256 of each of `names` (relative to `folder`)."""
    return {
        name: {"size": (folder / name).stat().st_size, "digest": digest_of(folder / name)}
        for name in names
    }


def manifest_text(records: dict[str, dict[str, int | str]]) -> str:
    return json.dumps({"digest": DIGEST, "files": records}, indent=1, sort_keys=True)


def read_manifest(folder: str | os.PathLike[str]) -> dict[str, dict[str, int | str]] | None:
    """The manifest's records (name -> size and digest), None for a folder saved before
    Temper wrote manifests. A manifest of the first format (sizes only) gives records
    without a digest."""
    path = Path(folder) / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if manifest.get("digest", DIGEST) != DIGEST:
            raise ValueError(f"digest {manifest['digest']!r}, this Temper knows {DIGEST!r}")
        return {
            name: record if isinstance(record, dict) else {"size": int(record)}
            for name, record in files.items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise IncompleteCheckpoint(f"{path}: unreadable manifest ({err})") from err


def check_files(
    folder: Path, records: dict[str, dict[str, int | str]], names: Sequence[str], digests: bool
) -> None:
    """Raise IncompleteCheckpoint naming the first of `names` that is missing, of another
    size or digest than its record."""
    for name in names:
        file = inside(folder, name, links=False)
        if not file.is_file():
            raise IncompleteCheckpoint(f"{file}: missing (the checkpoint's manifest lists it)")
        record = records[name]
        size = file.stat().st_size
        if size != record["size"]:
            raise IncompleteCheckpoint(
                f"{file}: {size} bytes, the checkpoint wrote {record['size']} "
                "(truncated or replaced)"
            )
        if digests and "digest" in record and digest_of(file) != record["digest"]:
            raise IncompleteCheckpoint(
                f"{file}: its SHA-256 digest differs from the one the save recorded (the file "
                "was damaged or altered since)"
            )


def check_listing(folder: Path, records: dict[str, dict[str, int | str]] | None) -> None:
    """Raise UnsafePath on a symlink anywhere in the folder (Temper writes none; one that
    leads out would be read, or copied by an export) and IncompleteCheckpoint on a file the
    save did not write."""
    present = listed_files(folder)
    for name in present if records is not None else ():
        if name not in records:
            raise IncompleteCheckpoint(
                f"{folder / name}: not written by the save (its manifest does not list it)"
            )


_VERIFIED: set[tuple] = set()
"""Folders this process verified, by path and every file's size and modification time:
resuming checks a checkpoint once, then loads it without reading every byte a second time,
and a file written since is read again."""


def verify(folder: str | os.PathLike[str], digests: bool = True) -> None:
    """Raise IncompleteCheckpoint naming the first file of `folder` that is missing, of
    another size or SHA-256 than its manifest records, a symlink, or not written by the save.

    With a process group up, this is a collective: each rank reads its share of the files
    (largest first, dealt round-robin) and every rank raises the same error. A folder
    without a manifest (saved before Temper wrote one) is checked for symlinks only. A
    symlink raises UnsafePath: no save writes one, so it is refused, not stepped over.
    ``digests=False`` checks sizes only (one ``stat`` a file: the pre-flight's quick look,
    before the ranks read every byte).
    """
    folder = Path(folder)
    records = read_manifest(folder)
    check_listing(folder, records)
    if records is None:
        return
    key = _identity(folder)
    if key in _VERIFIED:
        return
    by_size = sorted(records, key=lambda name: (-int(records[name]["size"]), name))
    rank, world = _rank_and_world()
    try:
        check_files(folder, records, by_size[rank::world], digests)
        found = None
    except IncompleteCheckpoint as err:
        found = str(err)
    failures = [message for message in _gathered(found, world) if message is not None]
    if failures:
        raise IncompleteCheckpoint(failures[0])
    if digests:
        _VERIFIED.add(key)


def _identity(folder: Path) -> tuple:
    stats = [(path, path.stat()) for path in sorted(folder.rglob("*")) if path.is_file()]
    return (str(folder.resolve()), *((str(p), s.st_size, s.st_mtime_ns) for p, s in stats))


def _rank_and_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gathered(message: str | None, world: int) -> list[str | None]:
    if world == 1:
        return [message]
    messages: list[str | None] = [None] * world
    dist.all_gather_object(messages, message)
    return messages
