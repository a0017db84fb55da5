"""The sft format: chat samples, loss on the tokens that train, packed or padded.

A record holds ``messages`` (and optionally ``tools``); it is tokenized with the chat template
(``temper.data.chat``).
Its next-token labels are ``ids[1:]`` where that token trains, else ignored. Unpacked, each
row is one sample, right-padded to ``seq_len``. Packed, whole samples fill a row, chosen
best-fit decreasing from a lookahead buffer of ``pack_buffer`` samples
(``temper.data.packing.BestFitPacker``); ``position_ids`` restart at each sample, so with
block-causal attention (``DocumentMask``) no token attends to, or is predicted from, another
sample.

Over-long samples (more than ``seq_len + 1`` tokens) follow ``max_length_policy``: truncate
keeps the first tokens, drop skips the sample; a sample left with no trained label is
dropped. Both are counted as the stream reads them and logged with the metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Literal

import torch

from temper.config import Data
from temper.data.batch import IGNORE_INDEX, REAL_TOKENS
from temper.data.chat import (
    DEFAULT_LIMITS,
    TemplateLimits,
    check_messages,
    check_tools,
    read_jsonl,
    tokenize_chat,
)
from temper.data.packing import BestFitPacker, RowPacker
from temper.data.sources import ListSource, Record
from temper.data.stream import LaneStream
from temper.data.tokenizer import Tokenizer

Policy = Literal["truncate", "drop"]
Sample = tuple[list[int], list[bool]]
Row = dict[str, torch.Tensor]

PACK_BUFFER = Data.pack_buffer


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


def sft_row(samples: Sequence[Sample], seq_len: int, fill: int, pack: bool) -> Row:
    """The row of ``samples`` (whole, in order), right-padded to ``seq_len``; packed rows carry
    per-sample ``position_ids``, the padding counting as one more. ``REAL_TOKENS`` says how
    many positions are not padding (the throughput's real work)."""
    input_ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    for sample in samples:
        inputs, targets = sample_labels(*sample)
        input_ids += inputs
        labels += targets
        positions += range(len(inputs))
    pad = seq_len - len(input_ids)
    row = {
        "input_ids": torch.tensor(input_ids + [fill] * pad),
        "labels": torch.tensor(labels + [IGNORE_INDEX] * pad),
        REAL_TOKENS: torch.tensor(len(input_ids)),
    }
    if pack:
        row["position_ids"] = torch.tensor(positions + list(range(pad)))
    return row


def sample_width(sample: Sample) -> int:
    """Positions a sample takes in a row: its inputs, all tokens but the last."""
    return len(sample[0]) - 1


def sft_packer(seq_len: int, fill: int, pack: bool, buffer: int) -> BestFitPacker | RowPacker:
    """One padded sample a row, or (``pack``) whole samples best-fit from ``buffer`` read
    ahead."""
    build = partial(sft_row, seq_len=seq_len, fill=fill, pack=pack)
    if not pack:
        return RowPacker(lambda reader: build([reader.take()]))
    return BestFitPacker(seq_len, buffer, sample_width, build)


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
        pack_buffer: int = PACK_BUFFER,
        policy: Policy = "truncate",
        limits: TemplateLimits = DEFAULT_LIMITS,
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.seq_len = seq_len
        self.train_on_prompt = train_on_prompt
        self.pack = pack
        self.pack_buffer = pack_buffer
        self.policy = policy
        self.limits = limits

    def encode(self, record: Record, where: str) -> tuple[Sample | None, str | None]:
        messages = check_messages(record.get("messages"), where)
        tools = check_tools(record.get("tools"), where)
        sample = tokenize_chat(
            self.tokenizer, self.template, messages, self.train_on_prompt, self.limits, tools
        )
        return fit(sample, self.seq_len + 1, self.policy)

    def tokens(self, sample: Sample) -> int:
        return len(sample[0])

    def packer(self) -> BestFitPacker | RowPacker:
        return sft_packer(self.seq_len, pad_id(self.tokenizer), self.pack, self.pack_buffer)


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
    pack_buffer: int = PACK_BUFFER,
    policy: Policy = "truncate",
    seed: int = 0,
    lanes: int = 1,
    dp_rank: int = 0,
    dp_world: int = 1,
) -> LaneStream:
    """The SFT row stream of in-memory ``conversations`` (see ``LaneStream`` for ``lanes``)."""
    source = ListSource([{"messages": c} for c in conversations], "conversations")
    fmt = SFTFormat(
        tokenizer,
        template,
        seq_len,
        train_on_prompt=train_on_prompt,
        pack=pack,
        pack_buffer=pack_buffer,
        policy=policy,
    )
    return LaneStream([source], fmt, lanes=lanes, dp_rank=dp_rank, dp_world=dp_world, seed=seed)
