import itertools
import json
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import tokenizers
import torch
from tokenizers import models, pre_tokenizers

from temper.data import (
    BatchLoader,
    LaneStream,
    Tokenizer,
    build_text_loader,
    load_tokenizer,
    merge_states,
    synthetic_document,
    text_dataset,
)

# Word-level tokenizer whose ids are known by hand: EOS = 0, "a".."i" = 1..9.
WORDS = {"<|endoftext|>": 0, **{letter: i + 1 for i, letter in enumerate("abcdefghi")}}
# Three documents "a b c", "d e", "f g h i", each followed by EOS: one epoch of the stream.
EPOCH = [1, 2, 3, 0, 4, 5, 0, 6, 7, 8, 9, 0]
# Rows of seq_len + 1 = 6 tokens, each starting at the last token of the previous row;
# row 2 crosses the epoch boundary.
ROWS_SEQ5 = [
    [1, 2, 3, 0, 4, 5],
    [5, 0, 6, 7, 8, 9],
    [9, 0, 1, 2, 3, 0],
    [0, 4, 5, 0, 6, 7],
    [7, 8, 9, 0, 1, 2],
]


@pytest.fixture(scope="module")
def words() -> Tokenizer:
    raw = tokenizers.Tokenizer(models.WordLevel({**WORDS, "[UNK]": 10}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(raw)


@pytest.fixture(scope="module")
def builtin() -> Tokenizer:
    return load_tokenizer(None)


@pytest.fixture
def txt_file(tmp_path: Path) -> str:
    path = tmp_path / "docs.txt"
    # Separators: one blank line, then a whitespace-only line plus a blank line.
    path.write_text("a b c\n\nd e\n \n\nf g\nh i\n")
    return str(path)


@pytest.fixture
def jsonl_file(tmp_path: Path) -> str:
    path = tmp_path / "docs.jsonl"
    lines = [{"body": "a b c"}, {"body": "d e", "id": 2}, {"body": "f g h i"}]
    path.write_text("\n".join(json.dumps(line) for line in lines[:2]) + "\n\n")
    with path.open("a") as file:
        file.write(json.dumps(lines[2]) + "\n")
    return str(path)


def _rows(dataset: LaneStream, count: int) -> list[list[int]]:
    """Whole rows (inputs plus the last label), after checking labels are inputs shifted."""
    rows = []
    for sample in itertools.islice(dataset, count):
        inputs, labels = sample["input_ids"], sample["labels"]
        assert inputs.dtype == labels.dtype == torch.long
        assert torch.equal(inputs[1:], labels[:-1])
        rows.append([*inputs.tolist(), labels[-1].item()])
    return rows


# Synthetic generator


def test_synthetic_is_deterministic_and_index_independent() -> None:
    forward = [synthetic_document(3, i) for i in range(20)]
    backward = [synthetic_document(3, i) for i in reversed(range(20))]
    assert forward == backward[::-1]
    assert all(
        a != b for a, b in zip(forward, [synthetic_document(4, i) for i in range(20)], strict=True)
    )
    # Pinned: the stream (and the tokenizer trained on it) must not drift across Python
    # versions or processes.
    assert synthetic_document(0, 1) == (
        "0 * 7 = 0\n9 + 99 = 108\n58 + 9 = 67\n82 + 40 = 122\ncopy: w z q f m e -> w z q f m e"
    )


ARITHMETIC = re.compile(r"(\d+) ([-+*]) (\d+) = (\d+)")
COPY = re.compile(r"copy: ((?:[a-z] )*[a-z]) -> (.*)")
SORT = re.compile(r"sort: ((?:\d )*\d) -> (.*)")
NOUN_PHRASE = r"(?:the|a|one|every) (?:[a-z]+ )?[a-z]+"
SENTENCE = re.compile(
    rf"({NOUN_PHRASE}) [a-z]+s ({NOUN_PHRASE})(?: (?:in|near|at|on)(?: the)? [a-z]+)?\."
)


def test_synthetic_tasks_are_correct() -> None:
    kinds: Counter[str] = Counter()
    sentence_words: set[str] = set()
    for index in range(300):
        lines = synthetic_document(11, index).split("\n")
        assert 3 <= len(lines) <= 6
        for line in lines:
            if match := ARITHMETIC.fullmatch(line):
                a, op, b, result = match.groups()
                expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}
                assert int(result) == expected[op], line
                kinds[op] += 1
            elif match := COPY.fullmatch(line):
                assert match[1] == match[2], line
                kinds["copy"] += 1
            elif match := SORT.fullmatch(line):
                digits = match[1].split()
                assert match[2].split() == sorted(digits), line
                kinds["sort"] += 1
            else:
                assert SENTENCE.fullmatch(line[0].lower() + line[1:]), line
                assert line[0].isupper()
                sentence_words.update(line.rstrip(".").lower().split())
                kinds["sentence"] += 1
    assert set(kinds) == {"+", "-", "*", "copy", "sort", "sentence"}
    # A small word vocabulary is what makes the stream learnable in a few steps.
    assert len(sentence_words) < 50


# Packing (one lane: the files' documents in order, epoch after epoch)


def test_packing_txt_by_hand(words: Tokenizer, txt_file: str) -> None:
    dataset = text_dataset(words, 5, path=txt_file)
    assert _rows(dataset, 5) == ROWS_SEQ5
    sample = next(iter(text_dataset(words, 5, path=txt_file)))
    assert sample["input_ids"].tolist() == [1, 2, 3, 0, 4]
    assert sample["labels"].tolist() == [2, 3, 0, 4, 5]


def test_packing_jsonl_uses_text_field(words: Tokenizer, jsonl_file: str) -> None:
    assert _rows(text_dataset(words, 5, path=jsonl_file, text_field="body"), 5) == ROWS_SEQ5


def test_directory_files_in_sorted_path_order(words: Tokenizer, tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("d e\n")
    (tmp_path / "sub" / "c.txt").write_text("f g\n\nh i")
    (tmp_path / "a.jsonl").write_text('{"text": "a b c"}\n')
    (tmp_path / "notes.md").write_text("x y z")
    dataset = text_dataset(words, 13, path=str(tmp_path))
    assert _rows(dataset, 1) == [[1, 2, 3, 0, 4, 5, 0, 6, 7, 0, 8, 9, 0, 1]]


# Lanes and ranks


def test_lanes_read_every_lanes_th_document(words: Tokenizer, txt_file: str) -> None:
    """Lane j packs positions j, j + lanes, ...: with 2 lanes over documents 0 1 2, lane 0
    reads 0 2 1 0 ... and lane 1 reads 1 0 2 1 ...; rows alternate between them."""
    rows = _rows(text_dataset(words, 5, path=txt_file, lanes=2), 4)
    assert rows == [
        [1, 2, 3, 0, 6, 7],  # lane 0: a b c | f g h i | d e ...
        [4, 5, 0, 1, 2, 3],  # lane 1: d e | a b c | f g h i ...
        [7, 8, 9, 0, 4, 5],
        [3, 0, 6, 7, 8, 9],
    ]


class CountingSource:
    """The synthetic stream (position = document index), recording which records are read."""

    def __init__(self, reads: Counter[int]) -> None:
        from temper.data.sources import SyntheticSource

        self.inner = SyntheticSource(7)
        self.reads = reads
        self.name, self.num_records, self.fields = "counted", None, ("text",)

    def record(self, index: int) -> dict:
        self.reads[index] += 1
        return self.inner.record(index)

    def where(self, index: int) -> str:
        return f"counted {index}"


def _ranks(
    tokenizer: Tokenizer, world: int, reads: Counter[int], lanes: int = 4, seq_len: int = 16
) -> list[LaneStream]:
    from temper.data.text import TextFormat

    return [
        LaneStream(
            [CountingSource(reads)],
            TextFormat(tokenizer, seq_len),
            lanes=lanes,
            dp_rank=rank,
            dp_world=world,
        )
        for rank in range(world)
    ]


def _steps(ranks: list[LaneStream], steps: int) -> list[list[list[int]]]:
    """``steps`` global batches: each rank's rows of its lanes, in rank order."""
    iterators = [iter(rank) for rank in ranks]
    per_rank = len(ranks[0]._lanes)
    batches = []
    for _ in range(steps):
        batch = []
        for rows in iterators:
            for row in itertools.islice(rows, per_rank):
                batch.append([*row["input_ids"].tolist(), row["labels"][-1].item()])
        batches.append(batch)
    return batches


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_reads_only_its_documents_and_the_batches_match(
    builtin: Tokenizer, world: int
) -> None:
    """A step's global batch is the same at any data-parallel size, and the ranks split the
    reading: no record is read by two ranks, together they read what one process reads."""
    alone: Counter[int] = Counter()
    reference = _steps(_ranks(builtin, 1, alone), 5)
    per_rank = [Counter() for _ in range(world)]
    ranks = [_ranks(builtin, world, per_rank[r])[r] for r in range(world)]
    assert _steps(ranks, 5) == reference
    assert sum(per_rank, Counter()) == alone
    assert all(set(a).isdisjoint(b) for a, b in itertools.combinations(per_rank, 2))
    assert max(alone.values()) == 1


@pytest.mark.parametrize("world", [2, 4])
def test_global_micro_batches_match_one_process(builtin: Tokenizer, world: int) -> None:
    """With gradient accumulation, the ranks' m-th micro-batches one after another are a
    single process's m-th micro-batch, rows in order: what layout parity compares, and what a
    loss that is not a sum over tokens (MoE balancing) needs."""
    from temper.data.sources import SyntheticSource
    from temper.data.text import TextFormat

    def loader(rank: int, world: int, micro_batch: int) -> BatchLoader:
        stream = LaneStream(
            [SyntheticSource(0)],
            TextFormat(builtin, 16),
            lanes=8,
            dp_rank=rank,
            dp_world=world,
            micro_batch=micro_batch,
        )
        return BatchLoader(stream, micro_batch)

    per_rank = 4 // world  # micro-batches of 4 rows over all ranks: 2 a step
    alone = loader(0, 1, 4)
    ranks = [iter(loader(r, world, per_rank)) for r in range(world)]
    for want in itertools.islice(alone, 6):
        got = torch.cat([next(rows)["input_ids"] for rows in ranks])
        assert torch.equal(got, want["input_ids"])


def test_resume_at_one_then_two_then_four_ranks(builtin: Tokenizer) -> None:
    """Simulated ranks: 3 steps at world 1, 3 at world 2, 3 at world 4, each resuming from the
    merged states of the last: the batches are the uninterrupted run's, every document is read
    once (none repeated, none skipped)."""
    straight_reads: Counter[int] = Counter()
    straight = _steps(_ranks(builtin, 1, straight_reads), 9)
    reads: Counter[int] = Counter()
    batches, state = [], None
    for world in (1, 2, 4):
        ranks = _ranks(builtin, world, reads)
        if state is not None:
            for rank in ranks:
                rank.load_state_dict(state)
        batches += _steps(ranks, 3)
        state = json.loads(json.dumps(merge_states([r.state_dict() for r in ranks])))
    assert batches == straight
    assert reads == straight_reads and max(reads.values()) == 1


def test_state_is_per_lane_and_plain(words: Tokenizer, txt_file: str) -> None:
    loader = build_text_loader(words, 5, 2, path=txt_file)  # 2 lanes
    next(iter(loader))
    state = loader.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert state["lanes"] == 2 and state["records"] == [3]
    # Lane 0 took documents 0 and 2 (a b c, f g h i) and keeps f g h i's tail after its row.
    assert state["lane"]["0"]["taken"] == [2] and state["lane"]["0"]["packer"] == {
        "buffer": [7, 8, 9, 0]
    }
    assert loader.stats == {
        "truncated": 0,
        "dropped": 0,
        "docs_documents": 4,
        "docs_tokens": 4 + 3 + 5 + 4,
    }


def test_restore_gives_the_next_batches(
    builtin: Tokenizer, words: Tokenizer, txt_file: str, jsonl_file: str
) -> None:
    for tokenizer, path, field in ((builtin, None, "text"), (words, jsonl_file, "body")):

        def loader(tokenizer=tokenizer, path=path, field=field) -> BatchLoader:
            return build_text_loader(tokenizer, 5, 2, path=path, text_field=field, seed=2)

        reference = list(itertools.islice(loader(), 6))
        interrupted = loader()
        batches = iter(interrupted)
        for _ in range(2):
            next(batches)
        restored = loader()
        restored.load_state_dict(json.loads(json.dumps(interrupted.state_dict())))
        resumed = zip(
            reference[2:], itertools.islice(restored, 4), itertools.islice(batches, 4), strict=True
        )
        for expected, got, continued in resumed:
            for key in ("input_ids", "labels"):
                assert torch.equal(got[key], expected[key])
                assert torch.equal(continued[key], expected[key])


def test_state_from_other_data_is_rejected(
    builtin: Tokenizer, words: Tokenizer, txt_file: str
) -> None:
    state = text_dataset(builtin, 5).state_dict()
    with pytest.raises(ValueError, match=r"sources of \[0\] records .* these have \[3\]"):
        text_dataset(words, 5, path=txt_file).load_state_dict(state)
    with pytest.raises(ValueError, match="saved with 1 lanes .* this run has 2"):
        text_dataset(builtin, 5, lanes=2).load_state_dict(state)
    half = text_dataset(builtin, 5, lanes=2, dp_rank=0, dp_world=2).state_dict()
    with pytest.raises(ValueError, match=r"lacks lanes \[1\]: gather every rank's state"):
        text_dataset(builtin, 5, lanes=2, dp_rank=1, dp_world=2).load_state_dict(half)


# Mixing


def _mixed(weights: list[float], lanes: int = 4, dp_rank: int = 0, dp_world: int = 1):
    from temper.data.chat import BUILTIN_TEMPLATE
    from temper.data.sft import SFTFormat
    from temper.data.sources import ListSource
    from temper.data.tasks import sft_conversations

    tokenizer = load_tokenizer(None)
    sources = [
        ListSource([{"messages": c} for c in sft_conversations(seed, "train", 50)], f"s{seed}")
        for seed in range(len(weights))
    ]
    fmt = SFTFormat(tokenizer, BUILTIN_TEMPLATE, 64)
    return LaneStream(
        sources,
        fmt,
        weights=weights,
        labels=["a", "b", "c"][: len(weights)],
        lanes=lanes,
        dp_rank=dp_rank,
        dp_world=dp_world,
    )


def test_mixing_honours_the_weights() -> None:
    """Documents are drawn by weight: over 3000 draws each share is within 3 binomial
    standard deviations of weight / sum (the tolerance docs/data.md states)."""
    stream = _mixed([3.0, 1.0, 2.0])
    rows = iter(stream)
    while sum(stream.stats[f"{k}_documents"] for k in "abc") < 3000:
        next(rows)
    counts = [stream.stats[f"{k}_documents"] for k in "abc"]
    total = sum(counts)
    for count, weight in zip(counts, [3 / 6, 1 / 6, 2 / 6], strict=True):
        sigma = (weight * (1 - weight) / total) ** 0.5
        assert abs(count / total - weight) < 3 * sigma
    assert all(stream.stats[f"{k}_tokens"] > 0 for k in "abc")


def test_mixing_resumes_exactly_at_another_world_size() -> None:
    straight = _mixed([1.0, 2.0])
    reference = [row["input_ids"] for row in itertools.islice(straight, 24)]
    first = _mixed([1.0, 2.0])
    head = [row["input_ids"] for row in itertools.islice(first, 8)]
    ranks = [_mixed([1.0, 2.0], dp_rank=r, dp_world=2) for r in range(2)]
    for rank in ranks:
        rank.load_state_dict(first.state_dict())
    iterators = [iter(rank) for rank in ranks]
    tail = []
    for _ in range(4):  # 4 steps of 4 lanes: 2 rows per rank each
        for rows in iterators:
            tail += [row["input_ids"] for row in itertools.islice(rows, 2)]
    assert all(torch.equal(a, b) for a, b in zip(head + tail, reference, strict=True))
    merged = merge_states([rank.state_dict() for rank in ranks])
    assert merged == {**straight.state_dict(), "lane": merged["lane"]}
    assert merged["lane"] == straight.state_dict()["lane"]


# Loader


class _ListDataset:
    def __init__(self, rows: list[int]) -> None:
        self.rows = rows

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return iter({"x": torch.tensor([row, -row])} for row in self.rows)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_batch_loader_stacks_rows_and_drops_a_partial_batch() -> None:
    batches = list(BatchLoader(_ListDataset([1, 2, 3, 4, 5]), 2))
    assert [b["x"].tolist() for b in batches] == [[[1, -1], [2, -2]], [[3, -3], [4, -4]]]


# Errors


def _write(path: Path, text: str | bytes) -> str:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.jsonl", '{"text": "a"}\n\n{"text": "b"\n', "bad.jsonl:3: invalid JSON"),
        ("bad.jsonl", '{"text": "a"}\n["a"]\n', "bad.jsonl:2: expected a JSON object, got list"),
        ("bad.jsonl", '{"text": "a"}\n{"body": "b"}\n', "bad.jsonl:2: record has no field 'text'"),
        ("bad.jsonl", '{"text": 7}\n', "bad.jsonl:1: field 'text' is int, expected a string"),
        ("bad.txt", b"a\n\nb\n\xff\n", "bad.txt:4: not valid UTF-8"),
        ("blank.txt", "\n  \n\n", "blank.txt: no documents found"),
        ("blank.jsonl", "\n\n", "blank.jsonl: no records (empty source)"),
        ("data.csv", "a,b\n", "data.csv: unsupported file type"),
        ("bad.jsonl.gz", b"not gzip", "bad.jsonl.gz: not a readable gzip file"),
        ("bad.parquet", b"PAR1 not really", "bad.parquet: not a readable parquet file"),
        ("bad.tokens", b"TEMPERTK", "bad.tokens: not a temper token file"),
    ],
)
def test_bad_files_are_named(
    words: Tokenizer, tmp_path: Path, name: str, content: str | bytes, message: str
) -> None:
    path = _write(tmp_path / name, content)
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / message))):
        list(itertools.islice(text_dataset(words, 4, path=path), 4))


def test_error_in_a_nested_file_names_it(words: Tokenizer, tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    _write(tmp_path / "a.txt", "a b\n")
    _write(tmp_path / "sub" / "z.jsonl", '{"text": "a"}\n{"text": null}\n')
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'sub' / 'z.jsonl'}:2: field")):
        list(itertools.islice(text_dataset(words, 4, path=str(tmp_path)), 4))


def test_missing_and_empty_paths_are_named(words: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=re.escape(f"{tmp_path / 'nope.txt'}: no such")):
        text_dataset(words, 4, path=str(tmp_path / "nope.txt"))
    _write(tmp_path / "readme.md", "not data")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path}: no .txt, .jsonl")):
        text_dataset(words, 4, path=str(tmp_path))


def test_bad_arguments(words: Tokenizer) -> None:
    with pytest.raises(ValueError, match="seq_len"):
        text_dataset(words, 0)
    with pytest.raises(ValueError, match="dp_rank"):
        text_dataset(words, 4, dp_rank=2, dp_world=2)
    with pytest.raises(ValueError, match="3 lanes do not split over 2"):
        text_dataset(words, 4, lanes=3, dp_world=2)
    with pytest.raises(ValueError, match="batch_size"):
        build_text_loader(words, 4, 0)
    with pytest.raises(ValueError, match=r"weights must be positive.*\[1.0, 0.0\]"):
        _mixed([1.0, 0.0])
