"""`manifest.json`: every file a checkpoint must contain and its size, checked at load.

Written last into the partial folder, just before the rename that publishes it, so it
lists exactly what the save wrote. A shard that was deleted, truncated or replaced by a
different-sized file since is named at load; `resume auto` then falls back to the
previous checkpoint. Sizes, not checksums: checking costs one `stat` per file, where a
checksum would read the whole checkpoint a second time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MANIFEST_FILE = "manifest.json"


class IncompleteCheckpoint(ValueError):
    """A checkpoint folder that lacks a file it recorded, or holds one of another size."""


def file_sizes(folder: Path) -> dict[str, int]:
    """Size of every file under `folder` by its relative path (the manifest excepted)."""
    return {
        path.relative_to(folder).as_posix(): path.stat().st_size
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != MANIFEST_FILE
    }


def manifest_text(folder: Path) -> str:
    return json.dumps({"files": file_sizes(folder)}, indent=1, sort_keys=True)


def verify(folder: str | os.PathLike[str]) -> None:
    """Raise IncompleteCheckpoint naming the first missing or wrongly sized file of `folder`.

    A folder without a manifest (written before Temper recorded one) passes unchecked.
    """
    folder = Path(folder)
    path = folder / MANIFEST_FILE
    if not path.is_file():
        return
    try:
        expected = json.loads(path.read_text())["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise IncompleteCheckpoint(f"{path}: unreadable manifest ({err})") from err
    for name, size in expected.items():
        file = folder / name
        if not file.is_file():
            raise IncompleteCheckpoint(f"{file}: missing (the checkpoint's manifest lists it)")
        actual = file.stat().st_size
        if actual != size:
            raise IncompleteCheckpoint(
                f"{file}: {actual} bytes, the checkpoint wrote {size} (truncated or replaced)"
            )
