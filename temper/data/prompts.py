"""RL prompts: a question for the policy to answer and the reference answer its reward checks.

A JSONL record holds ``prompt`` (a string, taken as a user message, or a message list) and
``answer`` (a string; the rewards decide what it means, ``""`` when a reward needs none). The
prompt is rendered with the chat template and its generation prompt (the opening of the
assistant turn), so the policy's completion is the assistant's answer.

A row carries ``prompt_ids`` left-padded to ``width`` with ``prompt_mask`` marking the real
tokens (generation takes prompts ending at the last column), and ``answer_ids``: the
answer's UTF-8 bytes, padded with -1, so rows stay tensors and the reward gets the exact text
back. A prompt longer than ``width`` tokens is dropped and counted: cutting a question would
change it. Order, sharding and resumption are ``ExampleStream``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from temper.data.chat import RecordError, check_messages, read_jsonl, render_chat
from temper.data.sft import ExampleStream, Row, pad_id
from temper.data.tokenizer import Tokenizer

PromptRecord = tuple[list[dict[str, str]], str]
"""(prompt messages, reference answer)."""

ANSWER_BYTES = 256
"""Room for a reference answer, in UTF-8 bytes."""


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
        answer = record.get("answer", "")
        if not isinstance(answer, str):
            raise RecordError(f"{where}: 'answer' must be a string")
        if len(answer.encode()) > ANSWER_BYTES:
            raise RecordError(f"{where}: 'answer' is longer than {ANSWER_BYTES} UTF-8 bytes")
        records.append((messages, answer))
    return records


def encode_answer(answer: str) -> torch.Tensor:
    data = list(answer.encode())
    return torch.tensor(data + [-1] * (ANSWER_BYTES - len(data)))


def decode_answer(row: torch.Tensor) -> str:
    """The answer text of one row's ``answer_ids``."""
    return bytes(b for b in row.tolist() if b >= 0).decode()


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
    for messages, answer in records:
        text = render_chat(template, messages, True, **tokenizer.special_tokens)
        ids = tokenizer.encode(text)
        if len(ids) <= width:
            kept.append((ids, answer))
    stats = {"truncated": 0, "dropped": len(records) - len(kept)}
    return ExampleStream(
        kept,
        _row_builder(width, pad_id(tokenizer)),
        seed=seed,
        dp_rank=dp_rank,
        dp_world=dp_world,
        stats=stats,
    )


def _row_builder(
    width: int, pad: int
) -> Callable[[Callable[[int], tuple[list[int], str] | None]], tuple[Row, int]]:
    def build(peek: Callable[[int], tuple[list[int], str] | None]) -> tuple[Row, int]:
        ids, answer = peek(0)
        n = width - len(ids)
        row = {
            "prompt_ids": torch.tensor([pad] * n + ids),
            "prompt_mask": torch.tensor([False] * n + [True] * len(ids)),
            "answer_ids": encode_answer(answer),
        }
        return row, 1

    return build
