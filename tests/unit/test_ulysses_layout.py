"""Ulysses batch slicing and head checks, without processes (the all-to-alls are tested on
gloo ranks in tests/distributed/test_ulysses.py)."""

from __future__ import annotations

import pytest
import torch

from temper.config import ConfigError
from temper.data.batch import DOCUMENT_POSITIONS, IGNORE_INDEX, SEQUENCE_SHARD, SequenceShard
from temper.models.fit import check_heads
from temper.objectives.causal_lm import documents
from temper.parallel.ulysses import PAD_POSITION, shard_batch


def _packed_batch() -> dict[str, torch.Tensor]:
    """One row of 5 tokens: documents of 2 and 3."""
    return {
        "input_ids": torch.tensor([[11, 12, 13, 14, 15]]),
        "labels": torch.tensor([[12, IGNORE_INDEX, 14, 15, 16]]),
        "position_ids": torch.tensor([[0, 1, 0, 1, 2]]),
    }


def test_shards_pad_right_and_keep_global_documents() -> None:
    shards = [shard_batch(_packed_batch(), rank, 2) for rank in range(2)]
    assert shards[1]["input_ids"].tolist() == [[14, 15, 0]]
    assert shards[1]["labels"].tolist() == [[15, 16, IGNORE_INDEX]]
    assert shards[0]["position_ids"].tolist() == [[0, 1, 0]]
    assert shards[1]["position_ids"].tolist() == [[1, 2, PAD_POSITION]]
    for shard in shards:
        assert shard[DOCUMENT_POSITIONS].tolist() == [[0, 1, 0, 1, 2, PAD_POSITION]]
        docs = documents(shard)
        assert docs is not None
        assert docs.doc_ids.tolist() == [[0, 0, 1, 1, 1, 2]]  # the pad is its own document


def test_shards_say_the_padded_length_and_their_real_tokens() -> None:
    """7 tokens over 3 ranks pad to 9: slices of 3 starting at 0, 3 and 6, with 3, 3 and 1
    real tokens of 7; 9 tokens over 4 ranks pad to 12, and the last slice is padding only."""
    batch = {"input_ids": torch.ones(2, 7, dtype=torch.long), "labels": torch.ones(2, 7)}
    shards = [shard_batch(batch, rank, 3)[SEQUENCE_SHARD] for rank in range(3)]
    assert shards == [
        SequenceShard(9, 3, start=0, real_len=7),
        SequenceShard(9, 3, start=3, real_len=7),
        SequenceShard(9, 1, start=6, real_len=7),
    ]
    batch = {key: torch.ones(1, 9) for key in ("input_ids", "labels")}
    shards = [shard_batch(batch, rank, 4)[SEQUENCE_SHARD] for rank in range(4)]
    assert [s.valid_len for s in shards] == [3, 3, 3, 0] and shards[0].seq_len == 12


def test_shards_of_continuous_rows_get_global_positions() -> None:
    batch = {"input_ids": torch.arange(8).view(2, 4), "labels": torch.arange(8).view(2, 4)}
    shard = shard_batch(batch, 1, 2)
    assert shard["position_ids"].tolist() == [[2, 3], [2, 3]]
    assert documents(shard) is None  # plain causal attention: no mask to build or hold


def test_shards_without_padding_cover_the_batch_once() -> None:
    batch = _packed_batch()
    batch = {k: torch.cat([v, v[:, :1]], dim=1) for k, v in batch.items()}
    shards = [shard_batch(batch, rank, 3) for rank in range(3)]
    for key in ("input_ids", "labels", "position_ids"):
        assert torch.equal(torch.cat([s[key] for s in shards], dim=1), batch[key])


def test_heads_split_or_kv_heads_replicate() -> None:
    check_heads(n_heads=8, n_kv_heads=4, sp=2)  # KV heads split
    check_heads(n_heads=8, n_kv_heads=2, sp=8)  # each KV head copied to 4 ranks
    with pytest.raises(ConfigError, match=r"parallelism.sp \(3\) must divide .* heads \(8\)"):
        check_heads(n_heads=8, n_kv_heads=4, sp=3)
    with pytest.raises(ConfigError, match=r"parallelism.sp \(4\) and .* KV heads \(6\)"):
        check_heads(n_heads=12, n_kv_heads=6, sp=4)
