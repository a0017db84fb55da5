"""Preference pairs for DPO: a prompt, a chosen and a rejected answer, as two padded rows.

A JSONL record holds ``prompt``, ``chosen`` and ``rejected``: strings (a user message and
assistant answers) or message lists (the prompt's turns, tool calls and results included;
the answers' assistant turns), and optionally ``tools``: function descriptions given to the
template with both conversations, as in sft records. As TRL does, the prompt is rendered with
its generation prompt and each answer is the text the whole conversation adds after it; only
the answer's tokens train, so an assistant turn inside a multi-turn prompt enters neither
log-probability sum. A row carries ``chosen_input_ids``/``chosen_labels`` and
``rejected_input_ids``/``rejected_labels``, each right-padded to ``seq_len``. An over-long
pair is truncated or dropped as a whole (``max_length_policy``) and counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from temper.data.batch import IGNORE_INDEX, REAL_TOKENS
from temper.data.chat import (
    DEFAULT_LIMITS,
    Message,
    RecordError,
    TemplateLimits,
    Tool,
    check_messages,
    check_tools,
    read_jsonl,
    render_chat,
    require_tools_written,
)
from temper.data.packing import RowPacker
from temper.data.sft import Policy, Row, Sample, fit, pad_id, sample_labels
from temper.data.sources import ListSource, Record
from temper.data.stream import LaneStream
from temper.data.tokenizer import Tokenizer

Pair = tuple[list[Message], list[Message], list[Message]]
"""(prompt messages, chosen answer messages, rejected answer messages)."""


def _turns(value: Any, where: str, field: str, role: str) -> list[Message]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if value is None:
        raise RecordError(f"{where}: record has no field {field!r}")
    return check_messages(value, where, field)


def record_pair(record: Record, where: str) -> Pair:
    """The (prompt, chosen, rejected) messages of a record, or RecordError at ``where``."""
    prompt = _turns(record.get("prompt"), where, "prompt", "user")
    chosen = _turns(record.get("chosen"), where, "chosen", "assistant")
    rejected = _turns(record.get("rejected"), where, "rejected", "assistant")
    for field, answer in (("chosen", chosen), ("rejected", rejected)):
        for j, message in enumerate(answer):
            if message["role"] != "assistant":
                raise RecordError(
                    f"{where}: {field}[{j}].role is {message['role']!r}; an answer holds "
                    "assistant turns only (every token after the prompt trains), earlier turns "
                    "go in 'prompt'"
                )
    return prompt, chosen, rejected


def read_preference_records(path: str, limit: int | None = None) -> list[Pair]:
    """The pairs of a JSONL file (the first ``limit``); a malformed record fails
    naming its file and line."""
    return [record_pair(record, where) for where, record in read_jsonl(path, limit)]


def answer_sample(
    tokenizer: Tokenizer,
    template: str,
    prompt: list[Message],
    answer: list[Message],
    limits: TemplateLimits = DEFAULT_LIMITS,
    tools: list[Tool] | None = None,
) -> Sample:
    """Ids of ``prompt`` (rendered with its generation prompt, never trained) then of the text
    ``prompt + answer`` adds after it (all trained), as TRL's DPOTrainer splits a pair; both
    renderings are given the record's ``tools``.

    Raises ValueError when the template does not render the conversation as a continuation of
    the prompt (the answer could not be located), or leaves out a tool or tool call."""
    options = {**tokenizer.special_tokens, "tools": tools, "limits": limits}
    head = render_chat(template, prompt, True, **options)
    full = render_chat(template, prompt + answer, **options)
    require_tools_written(full, prompt + answer, tools)
    if not full.startswith(head):
        raise ValueError(
            "the chat template does not render prompt + answer as a continuation of the prompt "
            "with its generation prompt, so the answer's tokens cannot be located"
        )
    prompt_ids = tokenizer.encode(head)
    answer_ids = tokenizer.encode(full[len(head) :])
    return prompt_ids + answer_ids, [False] * len(prompt_ids) + [True] * len(answer_ids)


def _pad(sample: Sample, seq_len: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, labels = sample_labels(*sample)
    n = seq_len - len(inputs)
    return torch.tensor(inputs + [pad] * n), torch.tensor(labels + [IGNORE_INDEX] * n)


def _row(pair: tuple[Sample, Sample], seq_len: int, pad: int) -> Row:
    row = {}
    for name, sample in zip(("chosen", "rejected"), pair, strict=True):
        row[f"{name}_input_ids"], row[f"{name}_labels"] = _pad(sample, seq_len, pad)
        row[f"{name}_{REAL_TOKENS}"] = torch.tensor(len(sample[0]) - 1)
    return row


class PreferenceFormat:
    """Records with ``prompt``, ``chosen`` and ``rejected`` to a pair of samples; a pair stays
    whole: it is kept only if both of its answers are (see the module docstring)."""

    required = (("prompt",), ("chosen",), ("rejected",))
    shuffle = True

    def __init__(
        self,
        tokenizer: Tokenizer,
        template: str,
        seq_len: int,
        policy: Policy = "truncate",
        limits: TemplateLimits = DEFAULT_LIMITS,
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.seq_len = seq_len
        self.policy = policy
        self.limits = limits

    def encode(self, record: Record, where: str) -> tuple[Any, str | None]:
        prompt, good, bad = record_pair(record, where)
        tools = check_tools(record.get("tools"), where)
        fitted, outcomes = [], []
        for answer in (good, bad):
            sample = answer_sample(
                self.tokenizer, self.template, prompt, answer, self.limits, tools
            )
            kept, outcome = fit(sample, self.seq_len + 1, self.policy)
            fitted.append(kept)
            outcomes.append(outcome)
        if None in fitted:
            return None, "dropped"
        return tuple(fitted), "truncated" if "truncated" in outcomes else None

    def tokens(self, pair: tuple[Sample, Sample]) -> int:
        return len(pair[0][0]) + len(pair[1][0])

    def packer(self) -> RowPacker:
        pad = pad_id(self.tokenizer)
        return RowPacker(lambda reader: _row(reader.take(), self.seq_len, pad))


def preference_dataset(
    pairs: Sequence[Pair],
    tokenizer: Tokenizer,
    template: str,
    seq_len: int,
    *,
    policy: Policy = "truncate",
    seed: int = 0,
    lanes: int = 1,
    dp_rank: int = 0,
    dp_world: int = 1,
) -> LaneStream:
    """The DPO row stream of in-memory ``pairs`` (see ``LaneStream`` for ``lanes``)."""
    records = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in pairs]
    return LaneStream(
        [ListSource(records, "pairs")],
        PreferenceFormat(tokenizer, template, seq_len, policy),
        lanes=lanes,
        dp_rank=dp_rank,
        dp_world=dp_world,
        seed=seed,
    )
