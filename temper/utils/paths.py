"""Confinement: every path a checkpoint or a model folder names stays inside that folder.

A folder Temper loads is data from somewhere else (a download, a colleague's run). The
names it holds (DCP storage files, safetensors index entries, tokenizer and template
files) are resolved through `inside`, which refuses an absolute name, a name that climbs
out with ``..`` and a symlink whose target lies outside the folder, naming the path. The
one layout whose symlinks point elsewhere by design is the Hugging Face hub cache: a
snapshot's files link to ``../../blobs/``, so there the repository's cache folder is the
boundary (`trust_root`).
"""

from __future__ import annotations

import os
from pathlib import Path


class UnsafePath(ValueError):
    """A path named by a loaded folder that would read (or copy) a file outside it."""


def trust_root(folder: str | os.PathLike[str]) -> Path:
    """The folder whose inside `folder`'s files may point to: itself, or for a hub cache
    snapshot (``models--org--name/snapshots/<revision>``) the repository's cache folder."""
    folder = Path(folder).absolute()
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent
    return folder


def inside(
    folder: str | os.PathLike[str], name: str | os.PathLike[str], *, links: bool = True
) -> Path:
    """``folder / name``, refused with UnsafePath when it leads out of the folder: an
    absolute `name`, ``..`` leaving it, or (followed) a symlink whose target lies outside
    `trust_root(folder)`. ``links=False`` refuses every symlink (a checkpoint Temper wrote
    holds none)."""
    folder = Path(folder)
    path = folder / name
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise UnsafePath(f"{path}: names a file outside {folder} (absolute or '..'); refused")
    relative_parts = Path(name).parts
    for depth in range(1, len(relative_parts) + 1):
        step = folder.joinpath(*relative_parts[:depth])
        if step.is_symlink() and not links:
            raise UnsafePath(f"{step}: a symlink inside a checkpoint (Temper writes none); refused")
    root = trust_root(folder).resolve()
    target = path.resolve()
    if target != root and root not in target.parents:
        raise UnsafePath(f"{path}: resolves to {target}, outside {trust_root(folder)}; refused")
    return path


def files_inside(folder: str | os.PathLike[str], *, links: bool = True) -> list[Path]:
    """Every regular file under `folder`, each checked with `inside` (sorted)."""
    folder = Path(folder)
    found = []
    for path in sorted(folder.rglob("*")):
        checked = inside(folder, path.relative_to(folder), links=links)
        if checked.is_file():
            found.append(checked)
    return found
