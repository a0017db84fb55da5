"""The sft format: chat samples, loss on the tokens that train, packed or padded.

A record holds ``messages``; it is tokenized with the chat template (``temper.data.chat``).
Its next-token labels are ``ids[1:]`` where that token trains, else ignored. Unpacked, each
row is one sample, right-padded to ``seq_len``. Packed, whole samples fill a row in order;
``position_ids`` restart at each sample, so with block-causal attention (``DocumentMask``)
no token attends to, or is predicted from, another sample. A sample that does not fit in the
rest of a row starts the next one.

Over-long samples (more than ``seq_len + 1`` tokens) follow ``max_length_policy``: truncate
keeps the first tokens, drop skips the sample; a sample left with no trained label is
dropped. Both are counted as the stream reads them and logged with the metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch

from temper.data.batch import IGNORE_INDEX
from temper.data.chat import (
    DEFAULT_LIMITS,
    TemplateLimits,
    check_messages,
    read_jsonl,
    tokenize_chat,
)
from temper.data.packing import LaneReader, RowPacker
from temper.data.sources import ListSource, Record
from temper.data.stream import LaneStream
from temper.data.tokenizer import Tokenizer

Policy = Literal["truncate", "drop"]
Sample = tuple[list[int], list[bool]]
Row = dict[str, torch.Tensor]


def fit_sample(ids: list[int], trains: list[bool], max_tokens: int, policy: Policy) -> str | None:
    """What ``policy`` does to a sample: None (fits), "truncated" or "dropped"."""
    if len(ids) <= max_tokens:
        return None if any(trains[1:]) else "dropped"
    if policy == "drop" or not any(trains[1:max_tokens]):
        return "dropped"
    return "truncated"


def fit(sample: Sample, max_tokens: int, policy: Policy) -> tuple[Sample | None, str | None]:
    """The sample after ``policy`` (None when dropped) and what happened to it."""
    ids, trains = sample
    outcome = fit_sample(ids, trains, max_tokens, policy)
    if outcome == "dropped":
        return None, outcome
    return (ids[:max_tokens], trains[:max_tokens]), outcome


def sample_labels(ids: list[int], trains: list[bool]) -> tuple[list[int], list[int]]:
    """Inputs and next-token labels of one sample; a label that does not train is ignored."""
    labels = [t if train else IGNORE_INDEX for t, train in zip(ids[1:], trains[1:], strict=True)]
    return ids[:-1], labels


def sft_row_builder(seq_len: int, fill: int, pack: bool) -> Callable[[LaneReader], Row]:
    """One padded sample a row, or (``pack``) as many whole samples as fit."""

    def build(reader: LaneReader) -> Row:
        input_ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        while (sample := reader.peek()) is not None:
            inputs, targets = sample_labels(*sample)
            if input_ids and (not pack or len(input_ids) + len(inputs) > seq_len):
                break
            reader.take()
            input_ids += inputs
            labels += targets
            positions += range(len(inputs))
        pad = seq_len - len(input_ids)
        row = {
            "input_ids": torch.tensor(input_ids + [fill] * pad),
            "labels": torch.tensor(labels + [IGNORE_INDEX] * pad),
        }
        if pack:
            row["position_ids"] = torch.tensor(positions + list(range(pad)))
        return row

    return build


def pad_id(tokenizer: Tokenizer) -> int:
    """The padding id: pad, else EOS (padding is never attended to nor predicted: any id does)."""
    return tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id


class SFTFormat:
    """Records with ``messages`` to trainable samples (see the module docstring)."""

    required = (("messages",),)
    shuffle = True

    def __init__(
        self,
        tokenizer: Tokenizer,
        template: str,
        seq_len: int,
        *,
        train_on_prompt: bool = False,
        pack: bool = True,
        policy: Policy = "truncate",
        limits: TemplateLimits = DEFAULT_LIMITS,
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.seq_len = seq_len
        self.train_on_prompt = train_on_prompt
        self.pack = pack
        self.policy = policy
        self.limits = limits

    def encode(self, record: Record, where: str) -> tuple[Sample | None, str | None]:
        messages = check_messages(record.get("messages"), where)
        sample = tokenize_chat(
            self.tokenizer, self.template, messages, self.train_on_prompt, self.limits
        )
        return fit(sample, self.seq_len + 1, self.policy)

    def tokens(self, sample: Sample) -> int:
        return len(sample[0])

    def packer(self) -> RowPacker:
        return RowPacker(sft_row_builder(self.seq_len, pad_id(self.tokenizer), self.pack))


def read_sft_records(path: str, limit: int | None = None) -> list[list[dict[str, str]]]:
    """The ``messages`` of every record of a JSONL file (the first ``limit``); malformed ones
    fail at file:line."""
    return [
        check_messages(record.get("messages"), where) for where, record in read_jsonl(path, limit)
    ]


def sft_dataset(
    conversations: Sequence[Sequence[dict[str, str]]],
    tokenizer: Tokenizer,
    template: str,
    seq_len: int,
    *,
    train_on_prompt: bool = False,
    pack: bool = True,
    policy: Policy = "truncate",
    seed: int = 0,
    lanes: int = 1,
    dp_rank: int = 0,
    dp_world: int = 1,
) -> LaneStream:
    """The SFT row stream of in-memory ``conversations`` (see ``LaneStream`` for ``lanes``)."""
    source = ListSource([{"messages": c} for c in conversations], "conversations")
    fmt = SFTFormat(
        tokenizer, template, seq_len, train_on_prompt=train_on_prompt, pack=pack, policy=policy
    )
    return LaneStream([source], fmt, lanes=lanes, dp_rank=dp_rank, dp_world=dp_world, seed=seed)
