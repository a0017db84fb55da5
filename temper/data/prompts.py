"""RL prompts: a question for the policy to answer, and the record its rewards check.

A JSONL record holds ``prompt`` (a string, taken as a user message, or a message list, which
may hold tool calls and results), optionally ``tools`` (function descriptions the template
shows the policy, as in sft records), and any other fields a reward needs: ``answer`` (a
string when present) for the built-in ones, test cases, units, whatever a user's reward reads.
The prompt is rendered with the chat template (given the tools) and its generation prompt (the
opening of the assistant turn), so the policy's completion is the assistant's answer.

A row carries ``prompt_ids`` left-padded to ``width`` with ``prompt_mask`` marking the real
tokens (generation takes prompts ending at the last column), and ``record_ids``: the whole
record as JSON in UTF-8 bytes, padded with -1 to ``RECORD_BYTES``, so rows stay tensors and
the reward gets every field back exactly. A prompt longer than ``width`` tokens is dropped
and counted: cutting a question would change it. Order, sharding and resumption are
``LaneStream``'s.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from temper.data.chat import (
    DEFAULT_LIMITS,
    RecordError,
    TemplateLimits,
    check_messages,
    check_tools,
    read_jsonl,
    render_chat,
    require_tools_written,
)
from temper.data.packing import RowPacker
from temper.data.sft import Row, pad_id
from temper.data.sources import ListSource, Record
from temper.data.stream import LaneStream
from temper.data.tokenizer import Tokenizer

PromptRecord = tuple[list[dict[str, Any]], dict[str, Any]]
"""(prompt messages, the whole JSONL record)."""

RECORD_BYTES = 8192
"""Room for a prompt record as JSON, in UTF-8 bytes (rows of a stream share one width)."""


def record_prompt(record: Record, where: str) -> PromptRecord:
    """The (prompt messages, record) of a record, or RecordError at ``where``."""
    prompt = record.get("prompt")
    if prompt is None:
        raise RecordError(f"{where}: record has no field 'prompt'")
    messages = (
        [{"role": "user", "content": prompt}]
        if isinstance(prompt, str)
        else check_messages(prompt, where, "prompt")
    )
    check_tools(record.get("tools"), where)
    if not isinstance(record.get("answer", ""), str):
        raise RecordError(f"{where}: 'answer' must be a string")
    if len(_json_bytes(record)) > RECORD_BYTES:
        raise RecordError(f"{where}: the record is longer than {RECORD_BYTES} UTF-8 bytes as JSON")
    return messages, dict(record)


def read_prompt_records(path: str, limit: int | None = None) -> list[PromptRecord]:
    """The prompts of a JSONL file (the first ``limit``); a malformed record fails
    naming its file and line."""
    return [record_prompt(record, where) for where, record in read_jsonl(path, limit)]


def encode_record(record: dict[str, Any], width: int = RECORD_BYTES) -> torch.Tensor:
    """A record as JSON's UTF-8 bytes [width], padded with -1."""
    data = _json_bytes(record)
    return torch.tensor(data + [-1] * (width - len(data)))


def _json_bytes(record: dict[str, Any]) -> list[int]:
    return list(json.dumps(record, ensure_ascii=False).encode())


def decode_record(row: torch.Tensor) -> dict[str, Any]:
    """The record of one row's ``record_ids``."""
    return json.loads(bytes(b for b in row.tolist() if b >= 0).decode())


class PromptFormat:
    """Records with ``prompt`` (and any other fields) to the rendered prompt's ids and the
    record; a prompt longer than ``width`` is dropped (see the module docstring)."""

    required = (("prompt",),)
    shuffle = True

    def __init__(
        self,
        tokenizer: Tokenizer,
        template: str,
        width: int,
        limits: TemplateLimits = DEFAULT_LIMITS,
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.width = width
        self.limits = limits

    def encode(
        self, record: Record, where: str
    ) -> tuple[tuple[list[int], dict[str, Any]] | None, str | None]:
        messages, record = record_prompt(record, where)
        special = self.tokenizer.special_tokens
        tools = record.get("tools")
        text = render_chat(
            self.template, messages, True, tools=tools, limits=self.limits, **special
        )
        require_tools_written(text, messages, tools)
        ids = self.tokenizer.encode(text)
        return ((ids, record), None) if len(ids) <= self.width else (None, "dropped")

    def tokens(self, sample: tuple[list[int], dict[str, Any]]) -> int:
        return len(sample[0])

    def packer(self) -> RowPacker:
        pad = pad_id(self.tokenizer)
        return RowPacker(lambda reader: _row(*reader.take(), self.width, pad))


def _row(ids: list[int], record: dict[str, Any], width: int, pad: int) -> Row:
    n = width - len(ids)
    return {
        "prompt_ids": torch.tensor([pad] * n + ids),
        "prompt_mask": torch.tensor([False] * n + [True] * len(ids)),
        "record_ids": encode_record(record),
    }


def prompt_dataset(
    records: Sequence[PromptRecord],
    tokenizer: Tokenizer,
    template: str,
    width: int,
    *,
    seed: int = 0,
    lanes: int = 1,
    dp_rank: int = 0,
    dp_world: int = 1,
) -> LaneStream:
    """The prompt row stream of in-memory ``records`` (see ``LaneStream`` for ``lanes``)."""
    source = ListSource([{"prompt": m, **r} for m, r in records], "prompts")
    return LaneStream(
        [source],
        PromptFormat(tokenizer, template, width),
        lanes=lanes,
        dp_rank=dp_rank,
        dp_world=dp_world,
        seed=seed,
    )
