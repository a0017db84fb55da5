"""SFT rows: labels only on trained tokens, packing isolation, over-length policy, resumption."""

from __future__ import annotations

import itertools

import pytest
import torch

from temper.data.chat import BUILTIN_TEMPLATE
from temper.data.sft import fit, sft_dataset, sft_packer
from temper.data.tasks import preference_pairs, sft_conversations, wrong_answer
from temper.data.tokenizer import load_tokenizer

A = ([1, 2, 3, 4], [False, False, True, True])
B = ([5, 6, 7], [False, True, True])


class _Reader:
    """A lane reader over a list of samples, None once they run out."""

    def __init__(self, samples) -> None:
        self.samples = list(samples)

    def peek(self):
        return self.samples[0] if self.samples else None

    def take(self):
        return self.samples.pop(0)


def _rows(samples, seq_len: int, pack: bool) -> list[dict[str, list[int]]]:
    """Rows until every sample is in one; packed with a buffer of 1: in reading order."""
    packer = sft_packer(seq_len, fill=0, pack=pack, buffer=1)
    reader = _Reader(samples)
    rows = []
    while reader.samples or (pack and packer.waiting):
        rows.append({k: v.tolist() for k, v in packer.row(reader).items()})
    return rows


def test_unpacked_rows_by_hand() -> None:
    assert _rows([A, B], 4, pack=False) == [
        {"input_ids": [1, 2, 3, 0], "labels": [-100, 3, 4, -100], "real_tokens": 3},
        {"input_ids": [5, 6, 0, 0], "labels": [6, 7, -100, -100], "real_tokens": 2},
    ]


def test_packed_rows_restart_positions_per_sample() -> None:
    assert _rows([A, B, A], 6, pack=True) == [
        {"input_ids": [1, 2, 3, 5, 6, 0], "labels": [-100, 3, 4, 6, 7, -100],
         "real_tokens": 5, "position_ids": [0, 1, 2, 0, 1, 0]},
        {"input_ids": [1, 2, 3, 0, 0, 0], "labels": [-100, 3, 4, -100, -100, -100],
         "real_tokens": 3, "position_ids": [0, 1, 2, 0, 1, 2]},
    ]  # fmt: skip


def test_over_length_policy_is_counted() -> None:
    long = ([1, 2, 3, 4, 5, 6], [False, True, True, True, True, True])
    prompt_only = ([1, 2, 3, 4, 5, 6], [False] * 5 + [True])
    outcomes = [fit(s, 4, "truncate") for s in (A, long, prompt_only)]
    assert outcomes == [(A, None), ((long[0][:4], long[1][:4]), "truncated"), (None, "dropped")]
    outcomes = [fit(s, 4, "drop") for s in (A, long, prompt_only)]
    assert outcomes == [(A, None), (None, "dropped"), (None, "dropped")]


def test_the_stream_counts_what_the_policy_did() -> None:
    """A short, a long and a prompt-only conversation at seq_len 24, one a row: truncate keeps
    the long one cut to fill its row, drop skips it; the prompt-only one is always dropped.
    The counts are those of the documents read so far."""
    short = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    long = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b c " * 20}]
    prompt_only = [{"role": "user", "content": "a b " * 20}, {"role": "assistant", "content": "b"}]
    for policy in ("truncate", "drop"):
        stream = sft_dataset(
            [short, long, prompt_only],
            load_tokenizer(None),
            BUILTIN_TEMPLATE,
            24,
            pack=False,
            policy=policy,
        )
        rows = list(itertools.islice(stream, 6))
        full = sum(int(row["labels"][-1] != -100) for row in rows)  # the cut long answers
        stats = stream.stats
        assert stats["dropped"] == stats["source0_documents"] - 6
        assert stats["truncated"] == full
        assert full > 0 if policy == "truncate" else full == 0


def _dataset(dp_rank: int = 0, dp_world: int = 1, pack: bool = True):
    """Two lanes, so two ranks each own one."""
    return sft_dataset(
        sft_conversations(0, "train", 40),
        load_tokenizer(None),
        BUILTIN_TEMPLATE,
        48,
        pack=pack,
        seed=3,
        lanes=2,
        dp_rank=dp_rank,
        dp_world=dp_world,
    )


@pytest.mark.parametrize("pack", [True, False])
def test_resume_and_sharding_follow_the_lanes(pack: bool) -> None:
    full = list(itertools.islice(iter(_dataset(pack=pack)), 30))  # crosses an epoch
    shards = [list(itertools.islice(iter(_dataset(r, 2, pack)), 15)) for r in range(2)]
    for i, row in enumerate(full):
        assert torch.equal(shards[i % 2][i // 2]["input_ids"], row["input_ids"])
    first = _dataset(pack=pack)
    rows = iter(first)
    for _ in range(7):
        next(rows)
    resumed = _dataset(pack=pack)
    resumed.load_state_dict(first.state_dict())
    for expected, got in zip(full[7:], itertools.islice(iter(resumed), 10), strict=False):
        assert torch.equal(expected["labels"], got["labels"])


def test_builtin_tasks_hold_out_and_reject_wrongly() -> None:
    train = {c[0]["content"] for c in sft_conversations(0, "train", 200)}
    held_out = sft_conversations(0, "eval", 50)
    assert any(c[0]["content"] not in train for c in held_out)
    for _, chosen, rejected in preference_pairs(0, "eval", 50):
        assert chosen[0]["content"] != rejected[0]["content"]
        assert len(chosen[0]["content"]) == len(rejected[0]["content"])
    import random

    assert wrong_answer("1 2 3", random.Random(0)) != "1 2 3"


def test_a_stream_that_drops_everything_fails_instead_of_spinning() -> None:
    long = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b c " * 20}]
    stream = sft_dataset([long] * 3, load_tokenizer(None), BUILTIN_TEMPLATE, 24, policy="drop")
    with pytest.raises(ValueError, match="lane 0 drew 4 records in a row that the format dropped"):
        next(iter(stream))
