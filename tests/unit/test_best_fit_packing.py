"""The SFT packer, best-fit decreasing over a lookahead buffer: whole conversations with the
masks they have alone, rows fuller than reading order, a bounded buffer, and a stream that
is deterministic and resumes exactly (rows after a restore equal the uninterrupted run's)."""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter

import pytest
import torch

from bench.packing import RandomLengths, fill
from temper.config import Config, ConfigError
from temper.data.batch import IGNORE_INDEX, REAL_TOKENS
from temper.data.chat import BUILTIN_TEMPLATE
from temper.data.loader import check_data_config, stack_rows, trim_padding
from temper.data.packing import BestFitPacker
from temper.data.sft import Sample, sample_labels, sample_width, sft_dataset, sft_packer, sft_row
from temper.data.tasks import sft_conversations
from temper.data.tokenizer import load_tokenizer
from temper.kernels.attention import DocumentMask
from temper.models.qwen3.args import Qwen3Args
from temper.models.qwen3.model import Qwen3Transformer
from temper.objectives import CausalLM

SEQ = 64


class CountingReader:
    """A lane reader over a list of samples, counting what it hands out."""

    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples
        self.taken = 0

    def peek(self) -> Sample | None:
        return self.samples[self.taken] if self.taken < len(self.samples) else None

    def take(self) -> Sample:
        self.taken += 1
        return self.samples[self.taken - 1]


def _samples(count: int, seed: int, low: int = 5, high: int = 40) -> list[Sample]:
    """Distinct samples (the first token numbers them) of random lengths and masks."""
    rng = random.Random(seed)
    samples = []
    for i in range(count):
        n = rng.randint(low, high)
        trains = [rng.random() < 0.6 for _ in range(n)]
        trains[-1] = True
        samples.append(([1000 + i] + [rng.randrange(1, 900) for _ in range(n - 1)], trains))
    return samples


def _documents(row: dict[str, torch.Tensor]) -> list[tuple[list[int], list[int]]]:
    """The (inputs, labels) of each conversation of a packed row, cut where the attention's
    document mask cuts it, padding left out."""
    real = int(row[REAL_TOKENS])
    docs = DocumentMask.from_position_ids(row["position_ids"][None])
    cuts = docs.cu_seqlens.tolist()
    found = []
    for start, end in itertools.pairwise(cuts):
        if start < real:
            assert end <= real, "a document runs into the padding"
            found.append((row["input_ids"][start:end].tolist(), row["labels"][start:end].tolist()))
    return found


def test_conversations_stay_whole_with_the_masks_they_have_alone() -> None:
    """Every conversation is in exactly one row, whole, with the inputs, labels and positions
    (0 at its start) of its unpacked row; the padding gets no label."""
    samples = _samples(200, seed=1)
    reader = CountingReader(samples)
    packer = sft_packer(SEQ, fill=0, pack=True, buffer=16)
    rows = []
    while reader.peek() is not None or packer.waiting:
        rows.append(packer.row(reader))
    packed = Counter()
    for row in rows:
        assert row["input_ids"].shape == (SEQ,)
        real = int(row[REAL_TOKENS])
        assert (row["labels"][real:] == IGNORE_INDEX).all()
        for inputs, labels in _documents(row):
            packed[(tuple(inputs), tuple(labels))] += 1
    alone = Counter()
    for sample in samples:
        unpacked = sft_row([sample], SEQ, fill=0, pack=False)
        n = int(unpacked[REAL_TOKENS])
        inputs, labels = unpacked["input_ids"][:n].tolist(), unpacked["labels"][:n].tolist()
        assert n == sample_width(sample) and inputs == sample_labels(*sample)[0]
        alone[(tuple(inputs), tuple(labels))] += 1
    assert packed == alone


def test_rows_are_fuller_than_in_reading_order() -> None:
    """Conversations of 100-400 tokens in 1024-token rows (the benchmark's data, 300 rows):
    best fit over 64 fills >= 95%; reading order (buffer 1) fills about 86%."""
    assert fill(1024, 64, 300, 100, 400, seed=0) >= 0.95
    assert fill(1024, 1, 300, 100, 400, seed=0) < 0.9


def test_the_buffer_bound_and_the_wait_are_kept() -> None:
    """At most ``buffer`` conversations wait after a row, and each is in a row within
    ``2 * buffer`` rows of being read, short ones behind better fits included."""
    buffer = 8
    lengths = RandomLengths(2, 60, seed=3)
    samples = [lengths.take() for _ in range(400)]
    for i, (ids, _) in enumerate(samples):
        ids[0] = 10_000 + i  # numbered, to find them
    reader = CountingReader(samples)
    packer = sft_packer(SEQ, fill=0, pack=True, buffer=buffer)
    read_at: dict[int, int] = {}
    for row_index in range(150):
        before = reader.taken
        row = packer.row(reader)
        for i in range(before, reader.taken):
            read_at[i] = row_index
        assert len(packer.waiting) <= buffer
        assert reader.taken - len(packer.waiting) >= 0
        for token in row["input_ids"][: int(row[REAL_TOKENS])].tolist():
            if token >= 10_000:
                assert row_index - read_at[token - 10_000] <= 2 * buffer


def _stream(pack_buffer: int = 8):
    return sft_dataset(
        sft_conversations(0, "train", 40),
        load_tokenizer(None),
        BUILTIN_TEMPLATE,
        96,
        pack_buffer=pack_buffer,
        seed=5,
        lanes=2,
    )


def test_the_stream_is_deterministic_and_resumes_exactly_mid_epoch() -> None:
    """Two runs give the same rows; a run stopped after 7 rows (mid-epoch, conversations
    waiting in the buffer) and restored from its state, written as JSON as plain data, goes
    on with exactly the uninterrupted run's rows, across the epoch's end."""
    full = list(itertools.islice(iter(_stream()), 40))
    again = list(itertools.islice(iter(_stream()), 40))
    for a, b in zip(full, again, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    first = _stream()
    rows = iter(first)
    for _ in range(7):
        next(rows)
    state = json.loads(json.dumps(first.state_dict()))
    assert any(lane["packer"]["waiting"] for lane in state["lane"].values())
    resumed = _stream()
    resumed.load_state_dict(state)
    for expected, got in zip(full[7:], itertools.islice(iter(resumed), 33), strict=True):
        assert expected.keys() == got.keys()
        assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert first.stats["source0_documents"] > 0


def test_buffer_one_packs_in_reading_order() -> None:
    """With a buffer of one the packer is the previous one: whole samples in reading order,
    a new row when the next does not fit."""
    samples = _samples(60, seed=2)
    packer = BestFitPacker(SEQ, 1, sample_width, lambda chosen: {"ids": [s[0][0] for s in chosen]})
    reader = CountingReader(samples)
    got = []
    while reader.peek() is not None or packer.waiting:
        got.append(packer.row(reader)["ids"])
    expected, current, room = [], [], SEQ
    for ids, _ in samples:
        if len(ids) - 1 > room:
            expected.append(current)
            current, room = [], SEQ
        current.append(ids[0])
        room -= len(ids) - 1
    assert got == expected + [current]


def test_pack_buffer_must_be_positive() -> None:
    config = Config()
    config.data.pack_buffer = 0
    with pytest.raises(ConfigError, match="data.pack_buffer must be > 0"):
        check_data_config(config, 1)


@pytest.mark.parametrize("pack", [True, False])
def test_trimmed_batches_train_as_the_full_width(pack: bool) -> None:
    """Rows of 256 positions holding at most 97 real tokens: the loader cuts the batch to
    128, and the loss, its count and every gradient of a small Qwen3 equal those
    of the full width (packed rows: their padding is a document of its own; unpacked: it
    comes after every real token), in float64, where summation order does not show."""
    samples = _samples(4, seed=4, low=20, high=60)
    groups = [samples[:2], samples[2:]] if pack else [samples[:1], samples[1:2]]
    rows = [sft_row(group, 256, fill=0, pack=pack) for group in groups]
    full = stack_rows(rows)
    trimmed = trim_padding(full)
    longest = int(full[REAL_TOKENS].max())
    assert 64 < longest <= 128 if pack else 32 < longest <= 64
    assert trimmed["input_ids"].shape == (2, 128 if pack else 64)
    assert trimmed.keys() == full.keys()
    torch.manual_seed(0)
    args = Qwen3Args(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=1024,
                     ffn_hidden_dim=48)  # fmt: skip
    model = Qwen3Transformer(args).double()  # in float32 the sums' order shows (1e-6)
    results = []
    for batch in (full, trimmed):
        model.zero_grad()
        loss, count, _ = CausalLM().loss(model, batch)
        loss.backward()
        results.append((loss.detach(), count, [p.grad.clone() for p in model.parameters()]))
    (loss_full, n_full, grads_full), (loss_cut, n_cut, grads_cut) = results
    assert n_full == n_cut
    torch.testing.assert_close(loss_cut, loss_full, rtol=1e-12, atol=0)
    for cut, whole in zip(grads_cut, grads_full, strict=True):
        torch.testing.assert_close(cut, whole, rtol=1e-9, atol=1e-12)


def test_a_preference_batch_is_cut_alike_on_both_sides() -> None:
    """DPO concatenates the two sides, so both keep the width of the longest of either."""
    ids = torch.zeros(2, 256, dtype=torch.long)
    batch = {
        "chosen_input_ids": ids,
        "chosen_labels": ids,
        f"chosen_{REAL_TOKENS}": torch.tensor([3, 5]),
        "rejected_input_ids": ids,
        "rejected_labels": ids,
        f"rejected_{REAL_TOKENS}": torch.tensor([70, 2]),
    }
    trimmed = trim_padding(batch)
    assert {k: tuple(v.shape) for k, v in trimmed.items()} == {
        "chosen_input_ids": (2, 128),
        "chosen_labels": (2, 128),
        f"chosen_{REAL_TOKENS}": (2,),
        "rejected_input_ids": (2, 128),
        "rejected_labels": (2, 128),
        f"rejected_{REAL_TOKENS}": (2,),
    }
    assert trim_padding({"input_ids": ids, "labels": ids})["input_ids"].shape == (2, 256)
