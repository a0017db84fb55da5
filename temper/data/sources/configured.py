"""The sources a config names, opened for one split: ``data.sources`` (or ``data.path``)
with their weights, names and validation hold-out, ``validation.path``, or the built-in task.

What a format needs of its sources (the built-in task's records, a source readied after
opening) comes in as two functions, so this module knows no format.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from temper.config import Config, Data, DataSource
from temper.data.sources import RenamedSource, SliceSource, Source, open_source
from temper.data.tokenizer import Tokenizer


def configured_sources(data: Data) -> list[tuple[str, DataSource]]:
    """(flag prefix, source) of each configured source: ``data.sources``, else ``data.path``."""
    if data.sources:
        return [(f"data.sources.{i}", source) for i, source in enumerate(data.sources)]
    if data.path is not None:
        return [("data.path", DataSource(path=data.path))]
    return []


class Sources(NamedTuple):
    sources: list[Source]
    weights: list[float]
    labels: list[str]
    """Names of their logged counts: the file names, made unique with the index."""
    flags: list[str]
    """The flag each comes from, for error messages (``data.sources.1``)."""


def open_path(
    path: str,
    text_field: str,
    fields: dict[str, str],
    tokenizer: Tokenizer,
    max_record_bytes: int = Data.max_record_bytes,
) -> Source:
    """The records of ``path`` with the format's field names (``fields``: name -> column)."""
    fields = {"text": text_field, **fields}
    source = open_source(path, fields["text"], tokenizer.vocab_size, max_record_bytes)
    rename = {name: column for name, column in fields.items() if name != column}
    return RenamedSource(source, rename) if rename else source


def source_label(path: str) -> str:
    name = Path(path.rstrip("/")).name.split(".")[0]
    return re.sub(r"[^A-Za-z0-9_]+", "_", name) or "source"


def open_split(
    config: Config,
    tokenizer: Tokenizer,
    split: str,
    builtin: Callable[[Config, str], Source],
    opened: Callable[[Source, str], Source],
) -> Sources:
    """The sources of ``split`` ("train" or "validation"): ``builtin(config, split)`` when no
    path is configured; ``opened(source, path)`` readies each source opened from a path."""
    data, validation = config.data, config.validation
    if split == "validation" and validation.path is not None:
        try:
            source = opened(
                open_path(validation.path, data.text_field, {}, tokenizer, data.max_record_bytes),
                validation.path,
            )
        except (OSError, ValueError) as error:
            raise type(error)(f"validation.path {validation.path}: {error}") from None
        return Sources([source], [1.0], ["validation"], [f"validation.path {validation.path}"])
    entries = configured_sources(data)
    if not entries:
        return Sources([builtin(config, split)], [1.0], ["builtin"], ["the built-in tasks"])
    found = Sources([], [], [], [])
    for flag, entry in entries:
        try:
            source = open_path(
                entry.path, data.text_field, entry.fields, tokenizer, data.max_record_bytes
            )
        except (OSError, ValueError) as error:
            raise type(error)(f"{flag} {entry.path}: {error}") from None
        if validation.fraction > 0:
            n = source.num_records or 0
            held = math.ceil(validation.fraction * n)
            if held >= n:
                raise ValueError(f"{flag} {entry.path}: validation.fraction leaves no records")
            part = (0, n - held) if split == "train" else (n - held, n)
            source = SliceSource(source, *part, f"{source.name} ({split})")
        found.sources.append(opened(source, entry.path))
        found.weights.append(entry.weight)
        found.labels.append(entry.name or source_label(entry.path))
        found.flags.append(f"{flag} {entry.path}")
    repeated = {label for label in found.labels if found.labels.count(label) > 1}
    found.labels[:] = [f"{x}_{i}" if x in repeated else x for i, x in enumerate(found.labels)]
    return found
