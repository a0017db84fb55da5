"""RL prompts: a question for the policy to answer and the reference answer its reward checks.

A JSONL record holds ``prompt`` (a string, taken as a user message, or a message list) and
``answer`` (a string; the rewards decide what it means, ``""`` when a reward needs none). The
prompt is rendered with the chat template and its generation prompt (the opening of the
assistant turn), so the policy's completion is the assistant's answer.

A row carries ``prompt_ids`` left-padded to ``width`` with ``prompt_mask`` marking the real
tokens (generation takes prompts ending at the last column), and ``answer_ids``: the
answer's UTF-8 bytes, padded with -1, so rows stay tensors and the reward gets the exact text
back. A prompt longer than ``width`` tokens is dropped and counted: cutting a question would
change it. Order, sharding and resumption are ``LaneStream``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from temper.data.chat import RecordError, check_messages, read_jsonl, render_chat
from temper.data.packing import RowPacker
from temper.data.sft import Row, pad_id
from temper.data.sources import ListSource, Record
from temper.data.stream import LaneStream
from temper.data.tokenizer import Tokenizer

PromptRecord = tuple[list[dict[str, str]], str]
"""(prompt messages, reference answer)."""

ANSWER_BYTES = 256
"""Room for a reference answer, in UTF-8 bytes."""


def record_prompt(record: Record, where: str) -> PromptRecord:
    """The (prompt messages, answer) of a record, or RecordError at ``where``."""
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
    return messages, answer


def read_prompt_records(path: str, limit: int | None = None) -> list[PromptRecord]:
    """The prompts of a JSONL file (the first ``limit``); a malformed record fails
    naming its file and line."""
    return [record_prompt(record, where) for where, record in read_jsonl(path, limit)]


def encode_answer(answer: str) -> torch.Tensor:
    data = list(answer.encode())
    return torch.tensor(data + [-1] * (ANSWER_BYTES - len(data)))


def decode_answer(row: torch.Tensor) -> str:
    """The answer text of one row's ``answer_ids``."""
    return bytes(b for b in row.tolist() if b >= 0).decode()


class PromptFormat:
    """Records with ``prompt`` (and ``answer``) to the rendered prompt's ids and its answer;
    a prompt longer than ``width`` is dropped (see the module docstring)."""

    required = (("prompt",),)
    shuffle = True

    def __init__(self, tokenizer: Tokenizer, template: str, width: int) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.width = width

    def encode(self, record: Record, where: str) -> tuple[tuple[list[int], str] | None, str | None]:
        messages, answer = record_prompt(record, where)
        text = render_chat(self.template, messages, True, **self.tokenizer.special_tokens)
        ids = self.tokenizer.encode(text)
        return ((ids, answer), None) if len(ids) <= self.width else (None, "dropped")

    def tokens(self, sample: tuple[list[int], str]) -> int:
        return len(sample[0])

    def packer(self) -> RowPacker:
        pad = pad_id(self.tokenizer)
        return RowPacker(lambda reader: _row(*reader.take(), self.width, pad))


def _row(ids: list[int], answer: str, width: int, pad: int) -> Row:
    n = width - len(ids)
    return {
        "prompt_ids": torch.tensor([pad] * n + ids),
        "prompt_mask": torch.tensor([False] * n + [True] * len(ids)),
        "answer_ids": encode_answer(answer),
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
    source = ListSource([{"prompt": m, "answer": a} for m, a in records], "prompts")
    return LaneStream(
        [source],
        PromptFormat(tokenizer, template, width),
        lanes=lanes,
        dp_rank=dp_rank,
        dp_world=dp_world,
        seed=seed,
    )
