"""RL prompts: a question for the policy to answer, and the record its rewards check.

A JSONL record holds ``prompt`` (a string, taken as a user message, or a message list) and
any other fields a reward needs: ``answer`` (a string when present) for the built-in ones,
test cases, units, whatever a user's reward reads. The prompt is rendered with the chat
template and its generation prompt (the opening of the assistant turn), so the policy's
completion is the assistant's answer.

A row carries ``prompt_ids`` left-padded to ``width`` with ``prompt_mask`` marking the real
tokens (generation takes prompts ending at the last column), and ``record_ids``: the whole
record as JSON in UTF-8 bytes, padded with -1 to the dataset's longest, so rows stay tensors
and the reward gets every field back exactly. A prompt longer than ``width`` tokens is
dropped and counted: cutting a question would change it. Order, sharding and resumption are
``ExampleStream``'s.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import torch

from temper.data.chat import RecordError, check_messages, read_jsonl, render_chat
from temper.data.sft import ExampleStream, Row, pad_id
from temper.data.tokenizer import Tokenizer

PromptRecord = tuple[list[dict[str, str]], dict[str, Any]]
"""(prompt messages, the whole JSONL record)."""


def read_prompt_records(path: str, limit: int | None = None) -> list[PromptRecord]:
    """The prompts of a JSONL file (the first ``limit``); a malformed record fails
    naming its file and line."""
    records = []
    for where, record in read_jsonl(path, limit):
        prompt = record.get("prompt")
        if prompt is None:
            raise RecordError(f"{where}: record has no field 'prompt'")
        messages = (
            [{"role": "user", "content": prompt}]
            if isinstance(prompt, str)
            else check_messages(prompt, where, "prompt")
        )
        if not isinstance(record.get("answer", ""), str):
            raise RecordError(f"{where}: 'answer' must be a string")
        records.append((messages, record))
    return records


def encode_record(record: dict[str, Any], width: int) -> torch.Tensor:
    """A record as JSON's UTF-8 bytes [width], padded with -1."""
    data = _json_bytes(record)
    return torch.tensor(data + [-1] * (width - len(data)))


def _json_bytes(record: dict[str, Any]) -> list[int]:
    return list(json.dumps(record, ensure_ascii=False).encode())


def decode_record(row: torch.Tensor) -> dict[str, Any]:
    """The record of one row's ``record_ids``."""
    return json.loads(bytes(b for b in row.tolist() if b >= 0).decode())


def prompt_dataset(
    records: Sequence[PromptRecord],
    tokenizer: Tokenizer,
    template: str,
    width: int,
    *,
    seed: int = 0,
    dp_rank: int = 0,
    dp_world: int = 1,
) -> ExampleStream:
    """The prompt row stream of ``records`` (see the module docstring)."""
    kept = []
    for messages, record in records:
        text = render_chat(template, messages, True, **tokenizer.special_tokens)
        ids = tokenizer.encode(text)
        if len(ids) <= width:
            kept.append((ids, record))
    stats = {"truncated": 0, "dropped": len(records) - len(kept)}
    record_width = max((len(_json_bytes(record)) for _, record in kept), default=0)
    return ExampleStream(
        kept,
        _row_builder(width, pad_id(tokenizer), record_width),
        seed=seed,
        dp_rank=dp_rank,
        dp_world=dp_world,
        stats=stats,
    )


def _row_builder(
    width: int, pad: int, record_width: int
) -> Callable[[Callable[[int], tuple[list[int], dict[str, Any]] | None]], tuple[Row, int]]:
    def build(peek: Callable[[int], tuple[list[int], dict[str, Any]] | None]) -> tuple[Row, int]:
        ids, record = peek(0)
        n = width - len(ids)
        row = {
            "prompt_ids": torch.tensor([pad] * n + ids),
            "prompt_mask": torch.tensor([False] * n + [True] * len(ids)),
            "record_ids": encode_record(record, record_width),
        }
        return row, 1

    return build
