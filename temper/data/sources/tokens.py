"""Pretokenized shards: a flat array of token ids (uint16 or uint32) read by memory map, with
the offsets of its documents, so continued pretraining skips tokenization altogether.

Layout of a ``.tokens`` file (little-endian): the 8 bytes ``TEMPERTK``; the header's length
as a uint64; the header, JSON (``dtype``, ``documents``, ``tokens``, ``vocab_size``), padded
with spaces to a multiple of 8 bytes; ``documents + 1`` uint64 offsets (document ``i`` is
tokens ``[offsets[i], offsets[i + 1])``, EOS not included); the tokens. ``write_tokens``
writes one (``python -m temper.data.prepare`` from a corpus).
"""

from __future__ import annotations

import json
import mmap
import shutil
import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from temper.data.sources.base import Record

TOKEN_SUFFIX = ".tokens"
MAGIC = b"TEMPERTK"
DTYPES = {"uint16": (torch.uint16, "H"), "uint32": (torch.uint32, "I")}


def write_tokens(path: str | Path, documents: Iterable[Sequence[int]], vocab_size: int) -> int:
    """Write ``documents`` (token id lists) to a ``.tokens`` file; returns how many. The
    smallest dtype that holds ``vocab_size`` ids is used; the file appears whole or not at
    all (written beside, then renamed)."""
    if sys.byteorder != "little":
        raise RuntimeError("token files are little-endian; this machine is not")
    name = "uint16" if vocab_size <= 1 << 16 else "uint32"
    code = DTYPES[name][1]
    path = Path(path)
    body, final = path.with_suffix(".tokens.part"), path.with_suffix(".tokens.tmp")
    offsets = array("Q", [0])
    with body.open("wb") as out:
        for document in documents:
            ids = array(code, document)
            out.write(ids.tobytes())
            offsets.append(offsets[-1] + len(ids))
    header = {
        "dtype": name,
        "documents": len(offsets) - 1,
        "tokens": offsets[-1],
        "vocab_size": vocab_size,
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with final.open("wb") as out:
        out.write(MAGIC + struct.pack("<Q", len(text)) + text + offsets.tobytes())
        with body.open("rb") as tokens:
            shutil.copyfileobj(tokens, out)
    body.unlink()
    final.replace(path)
    return header["documents"]


class TokenSource:
    """The documents of a ``.tokens`` file, each ``{"input_ids": LongTensor}``."""

    fields = ("input_ids",)

    def __init__(self, path: Path, vocab_size: int | None = None) -> None:
        self.name = str(path)
        self.path = path
        with path.open("rb") as file:
            head = file.read(16)
            if len(head) < 16 or head[:8] != MAGIC:
                raise ValueError(f"{path}: not a temper token file (no {MAGIC.decode()} header)")
            (length,) = struct.unpack("<Q", head[8:])
            try:
                self.header = json.loads(file.read(length))
                dtype, code = DTYPES[self.header["dtype"]]
                documents, tokens = int(self.header["documents"]), int(self.header["tokens"])
            except (ValueError, KeyError) as error:
                raise ValueError(f"{path}: unreadable token file header ({error!r})") from None
            self._data = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
        start = 16 + length
        self._token_start = start + 8 * (documents + 1)
        expected = self._token_start + tokens * struct.calcsize(code)
        if len(self._data) != expected:
            raise ValueError(
                f"{path}: {len(self._data)} bytes, but its header describes {expected} "
                "(truncated or overwritten)"
            )
        self._offsets = torch.frombuffer(
            self._data, dtype=torch.int64, count=documents + 1, offset=start
        )
        if self._offsets[-1] != tokens or bool((self._offsets.diff() < 0).any()):
            raise ValueError(f"{path}: document offsets do not describe its {tokens} tokens")
        self.itemsize = struct.calcsize(code)
        self.tokens = (
            torch.frombuffer(self._data, dtype=dtype, count=tokens, offset=self._token_start)
            if tokens
            else torch.zeros(0, dtype=dtype)
        )
        self.num_records: int | None = documents
        if not documents:
            raise ValueError(f"{path}: no records (empty source)")
        if vocab_size is not None:
            self.check_vocab(vocab_size)

    def check_vocab(self, vocab_size: int, chunk: int = 1 << 24) -> None:
        """Raise naming the byte offset of the first id that is not below ``vocab_size``."""
        for begin in range(0, len(self.tokens), chunk):
            ids = self.tokens[begin : begin + chunk].to(torch.int64)
            bad = (ids >= vocab_size).nonzero()
            if len(bad):
                at = begin + int(bad[0])
                raise ValueError(
                    f"{self.path}: token id {int(ids[at - begin])} at byte offset "
                    f"{self._token_start + at * self.itemsize} is not below the vocabulary "
                    f"size {vocab_size}"
                )

    def record(self, index: int) -> Record:
        begin, end = int(self._offsets[index]), int(self._offsets[index + 1])
        return {"input_ids": self.tokens[begin:end].to(torch.int64)}

    def where(self, index: int) -> str:
        return f"{self.path} document {index}"
