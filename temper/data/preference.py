"""Preference pairs for DPO: a prompt, a chosen and a rejected answer, as two padded rows.

A JSONL record holds ``prompt``, ``chosen`` and ``rejected``: strings (a user message and
assistant answers) or message lists (the prompt's turns; the answers' assistant turns). Both
conversations are rendered with the chat template; the labels train only on the answer's
assistant tokens. A row carries ``chosen_input_ids``/``chosen_labels`` and
``rejected_input_ids``/``rejected_labels``, each right-padded to ``seq_len``. An over-long
pair is truncated or dropped as a whole (``max_length_policy``) and counted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from temper.data.batch import IGNORE_INDEX
from temper.data.chat import RecordError, check_messages, read_jsonl, tokenize_chat
from temper.data.sft import (
    ExampleStream,
    Policy,
    Row,
    Sample,
    pad_id,
    prepare_samples,
    sample_labels,
)
from temper.data.tokenizer import Tokenizer

Pair = tuple[list[dict[str, str]], list[dict[str, str]], list[dict[str, str]]]
"""(prompt messages, chosen answer messages, rejected answer messages)."""


def _turns(value: Any, where: str, field: str, role: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if value is None:
        raise RecordError(f"{where}: record has no field {field!r}")
    return check_messages(value, where, field)


def read_preference_records(path: str, limit: int | None = None) -> list[Pair]:
    """The pairs of a JSONL file (the first ``limit``); a malformed record fails
    naming its file and line."""
    pairs = []
    for where, record in read_jsonl(path, limit):
        prompt = _turns(record.get("prompt"), where, "prompt", "user")
        chosen = _turns(record.get("chosen"), where, "chosen", "assistant")
        rejected = _turns(record.get("rejected"), where, "rejected", "assistant")
        for field, answer in (("chosen", chosen), ("rejected", rejected)):
            if not any(m["role"] == "assistant" for m in answer):
                raise RecordError(f"{where}: {field!r} has no assistant message")
        pairs.append((prompt, chosen, rejected))
    return pairs


def _pad(sample: Sample, seq_len: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, labels = sample_labels(*sample)
    n = seq_len - len(inputs)
    return torch.tensor(inputs + [pad] * n), torch.tensor(labels + [IGNORE_INDEX] * n)


def _row_builder(
    seq_len: int, pad: int
) -> Callable[[Callable[[int], tuple[Sample, Sample] | None]], tuple[Row, int]]:
    def build(peek: Callable[[int], tuple[Sample, Sample] | None]) -> tuple[Row, int]:
        chosen, rejected = peek(0)
        row = {}
        for name, sample in (("chosen", chosen), ("rejected", rejected)):
            row[f"{name}_input_ids"], row[f"{name}_labels"] = _pad(sample, seq_len, pad)
        return row, 1

    return build


def preference_dataset(
    pairs: Sequence[Pair],
    tokenizer: Tokenizer,
    template: str,
    seq_len: int,
    *,
    policy: Policy = "truncate",
    seed: int = 0,
    dp_rank: int = 0,
    dp_world: int = 1,
) -> ExampleStream:
    """The DPO row stream of ``pairs`` (see the module docstring)."""
    chosen, rejected = [], []
    for prompt, good, bad in pairs:
        chosen.append(tokenize_chat(tokenizer, template, prompt + good))
        rejected.append(tokenize_chat(tokenizer, template, prompt + bad))
    # A pair stays whole: it is kept only if both of its answers are.
    stats = {"truncated": 0, "dropped": 0}
    kept = []
    for c, r in zip(chosen, rejected, strict=True):
        fitted_c, stats_c = prepare_samples([c], seq_len, policy)
        fitted_r, stats_r = prepare_samples([r], seq_len, policy)
        if fitted_c and fitted_r:
            kept.append((fitted_c[0], fitted_r[0]))
            stats["truncated"] += int(bool(stats_c["truncated"] or stats_r["truncated"]))
        else:
            stats["dropped"] += 1
    return ExampleStream(
        kept,
        _row_builder(seq_len, pad_id(tokenizer)),
        seed=seed,
        dp_rank=dp_rank,
        dp_world=dp_world,
        stats=stats,
    )
