"""Supervised fine-tuning rows: chat samples, loss on the tokens that train, packed or padded.

A sample is a tokenized conversation (``temper.data.chat``). Its next-token labels are
``ids[1:]`` where that token trains, else ignored. Unpacked, each row is one sample,
right-padded to ``seq_len``. Packed, whole samples fill a row in order; ``position_ids``
restart at each sample, so with block-causal attention (``DocumentMask``) no token attends
to, or is predicted from, another sample. A sample that does not fit in the rest of a row
starts the next one.

Over-long samples (more than ``seq_len + 1`` tokens) follow ``max_length_policy``: truncate
keeps the first tokens, drop skips the sample; a sample left with no trained label is
dropped. Both are counted (``stats``) and logged with the metrics.

Order, sharding and resumption follow ``TextDataset``: one global row stream (samples in a
seeded permutation per epoch), rank ``r`` of ``dp_world`` takes rows ``r, r + dp_world, ...``,
and the state is the group's position (epoch, next sample, rows so far).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch

from temper.data.batch import IGNORE_INDEX
from temper.data.chat import check_messages, read_jsonl, tokenize_chat
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


def sample_labels(ids: list[int], trains: list[bool]) -> tuple[list[int], list[int]]:
    """Inputs and next-token labels of one sample; a label that does not train is ignored."""
    labels = [t if train else IGNORE_INDEX for t, train in zip(ids[1:], trains[1:], strict=True)]
    return ids[:-1], labels


class ExampleStream:
    """Rows built from a list of examples in a seeded order, sharded and resumable.

    ``build_row(examples, start)`` returns a row and how many examples from ``start`` (in
    the epoch's order) it used; the examples are visited in a fresh permutation per epoch.
    """

    def __init__(
        self,
        examples: Sequence[Any],
        build_row: Callable[[Callable[[int], Any | None]], tuple[Row, int]],
        *,
        seed: int,
        dp_rank: int,
        dp_world: int,
        stats: dict[str, int],
    ) -> None:
        if not examples:
            raise ValueError("no examples left to train on (all were dropped as over-long)")
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"need 0 <= dp_rank < dp_world, got {dp_rank} and {dp_world}")
        self.examples = examples
        self.build_row = build_row
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.stats = stats
        self._epoch = 0
        self._next = 0
        self._row = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(len(self.examples), generator=generator).tolist()

    def _peek(self, offset: int) -> Any | None:
        """The example ``offset`` places after the cursor, within this epoch; else None."""
        index = self._next + offset
        return self.examples[self._order[index]] if index < len(self._order) else None

    def _next_global_row(self) -> Row:
        row, used = self.build_row(self._peek)
        self._next += used
        if self._next == len(self._order):
            self._epoch += 1
            self._next = 0
            self._order = self._permutation(self._epoch)
        self._row += 1
        return row

    def __iter__(self) -> Iterator[Row]:
        while True:
            for _ in range(self.dp_rank):
                self._next_global_row()
            row = self._next_global_row()
            for _ in range(self.dp_world - 1 - self.dp_rank):
                self._next_global_row()
            yield row

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "next": self._next,
            "row": self._row,
            "examples": len(self.examples),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("examples") != len(self.examples):
            raise ValueError(
                f"dataset state was saved for {state.get('examples')} examples, this data has "
                f"{len(self.examples)}; the data changed since the checkpoint"
            )
        self._epoch, self._next, self._row = state["epoch"], state["next"], state["row"]
        self._order = self._permutation(self._epoch)


def prepare_samples(
    samples: Sequence[Sample], seq_len: int, policy: Policy
) -> tuple[list[Sample], dict[str, int]]:
    """Samples after the over-length policy, and how many were truncated and dropped."""
    stats = {"truncated": 0, "dropped": 0}
    kept = []
    for ids, trains in samples:
        outcome = fit_sample(ids, trains, seq_len + 1, policy)
        if outcome is not None:
            stats[outcome] += 1
        if outcome != "dropped":
            kept.append((ids[: seq_len + 1], trains[: seq_len + 1]))
    return kept, stats


def sft_row_builder(
    seq_len: int, fill: int, pack: bool
) -> Callable[[Callable[[int], Sample | None]], tuple[Row, int]]:
    """Row builder for ``ExampleStream``: one padded sample, or as many whole ones as fit."""

    def build(peek: Callable[[int], Sample | None]) -> tuple[Row, int]:
        input_ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        used = 0
        while (sample := peek(used)) is not None:
            inputs, targets = sample_labels(*sample)
            if used and (not pack or len(input_ids) + len(inputs) > seq_len):
                break
            input_ids += inputs
            labels += targets
            positions += range(len(inputs))
            used += 1
        pad = seq_len - len(input_ids)
        row = {
            "input_ids": torch.tensor(input_ids + [fill] * pad),
            "labels": torch.tensor(labels + [IGNORE_INDEX] * pad),
        }
        if pack:
            row["position_ids"] = torch.tensor(positions + list(range(pad)))
        return row, used

    return build


def pad_id(tokenizer: Tokenizer) -> int:
    """The padding id: pad, else EOS (padding is never attended to nor predicted: any id does)."""
    return tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id


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
    dp_rank: int = 0,
    dp_world: int = 1,
) -> ExampleStream:
    """The SFT row stream of tokenized ``conversations`` (see the module docstring)."""
    samples = [tokenize_chat(tokenizer, template, c, train_on_prompt) for c in conversations]
    kept, stats = prepare_samples(samples, seq_len, policy)
    return ExampleStream(
        kept,
        sft_row_builder(seq_len, pad_id(tokenizer), pack),
        seed=seed,
        dp_rank=dp_rank,
        dp_world=dp_world,
        stats=stats,
    )
