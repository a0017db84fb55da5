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
    TextDataset,
    Tokenizer,
    build_text_loader,
    load_tokenizer,
    synthetic_document,
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


def _rows(dataset: TextDataset, count: int) -> list[list[int]]:
    """Whole rows (inputs plus the last label), after checking labels are inputs shifted."""
    rows = []
    for sample in itertools.islice(dataset, count):
        inputs, labels = sample["input_ids"], sample["labels"]
        assert inputs.dtype == labels.dtype == torch.long
        assert torch.equal(inputs[1:], labels[:-1])
        rows.append([*inputs.tolist(), labels[-1].item()])
    return rows


def _interleave(per_rank: list[list[list[int]]]) -> list[list[int]]:
    return [row for step in zip(*per_rank, strict=True) for row in step]


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


# Packing


def test_packing_txt_by_hand(words: Tokenizer, txt_file: str) -> None:
    dataset = TextDataset(words, 5, path=txt_file)
    assert _rows(dataset, 5) == ROWS_SEQ5
    sample = next(iter(TextDataset(words, 5, path=txt_file)))
    assert sample["input_ids"].tolist() == [1, 2, 3, 0, 4]
    assert sample["labels"].tolist() == [2, 3, 0, 4, 5]


def test_packing_jsonl_uses_text_field(words: Tokenizer, jsonl_file: str) -> None:
    assert _rows(TextDataset(words, 5, path=jsonl_file, text_field="body"), 5) == ROWS_SEQ5


def test_directory_files_in_sorted_path_order(words: Tokenizer, tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("d e\n")
    (tmp_path / "sub" / "c.txt").write_text("f g\n\nh i")
    (tmp_path / "a.jsonl").write_text('{"text": "a b c"}\n')
    (tmp_path / "notes.md").write_text("x y z")
    dataset = TextDataset(words, 13, path=str(tmp_path))
    assert _rows(dataset, 1) == [[1, 2, 3, 0, 4, 5, 0, 6, 7, 0, 8, 9, 0, 1]]


# Sharding


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_partition_the_global_rows(builtin: Tokenizer, world: int) -> None:
    reference = _rows(TextDataset(builtin, 16, seed=5), 4 * world)
    per_rank = [
        _rows(TextDataset(builtin, 16, seed=5, dp_rank=rank, dp_world=world), 4)
        for rank in range(world)
    ]
    assert _interleave(per_rank) == reference


def test_ranks_partition_file_rows(words: Tokenizer, txt_file: str) -> None:
    per_rank = [TextDataset(words, 5, path=txt_file, dp_rank=r, dp_world=2) for r in range(2)]
    assert _interleave([_rows(d, 2) for d in per_rank]) == ROWS_SEQ5[:4]


# State


def _loader(kind: str, tokenizer: Tokenizer, path: str | None) -> BatchLoader:
    field = "body" if kind == "jsonl" else "text"
    return build_text_loader(tokenizer, 5, 2, path=path, text_field=field, seed=2)


@pytest.mark.parametrize("kind", ["synthetic", "txt", "jsonl"])
def test_restore_gives_the_next_batches(
    kind: str, builtin: Tokenizer, words: Tokenizer, txt_file: str, jsonl_file: str
) -> None:
    tokenizer, path = {
        "synthetic": (builtin, None),
        "txt": (words, txt_file),
        "jsonl": (words, jsonl_file),
    }[kind]
    reference = list(itertools.islice(_loader(kind, tokenizer, path), 6))
    interrupted = _loader(kind, tokenizer, path)
    batches = iter(interrupted)
    for _ in range(2):
        next(batches)
    # Plain ints and lists: the state survives a JSON round trip unchanged.
    state = json.loads(json.dumps(interrupted.state_dict()))
    assert state == interrupted.state_dict()
    assert state["row"] == 4
    if kind != "synthetic":
        # Row 3 ends at stream token 20 and the buffer keeps tokens 20..23: the tail of the
        # last document of epoch 1 (tokens 12..23), so reading resumes at epoch 2, document 0.
        expected_state = {"epoch": 2, "document": 0, "buffer": [7, 8, 9, 0], "row": 4}
        assert state == {**expected_state, "documents_per_epoch": 3}
    restored = _loader(kind, tokenizer, path)
    restored.load_state_dict(state)
    resumed = zip(
        reference[2:], itertools.islice(restored, 4), itertools.islice(batches, 4), strict=True
    )
    for expected, got, continued in resumed:
        for key in ("input_ids", "labels"):
            assert got[key].shape == (2, 5)
            assert torch.equal(got[key], expected[key])
            assert torch.equal(continued[key], expected[key])


def test_restore_at_another_world_size(builtin: Tokenizer) -> None:
    reference = _rows(TextDataset(builtin, 8, seed=1), 12)
    before = [TextDataset(builtin, 8, seed=1, dp_rank=r, dp_world=2) for r in range(2)]
    assert _interleave([_rows(d, 3) for d in before]) == reference[:6]
    state = before[0].state_dict()
    assert state == before[1].state_dict()
    assert state["row"] == 6
    for world in (1, 3):
        after = [TextDataset(builtin, 8, seed=1, dp_rank=r, dp_world=world) for r in range(world)]
        for dataset in after:
            dataset.load_state_dict(state)
        assert _interleave([_rows(d, 6 // world) for d in after]) == reference[6:]


def test_state_from_another_source_is_rejected(
    builtin: Tokenizer, words: Tokenizer, txt_file: str
) -> None:
    state = TextDataset(builtin, 5).state_dict()
    with pytest.raises(ValueError, match="0 documents per epoch .* this one has 3"):
        TextDataset(words, 5, path=txt_file).load_state_dict(state)
    with pytest.raises(ValueError, match=r"lacks \['buffer'\]"):
        TextDataset(builtin, 5).load_state_dict({k: v for k, v in state.items() if k != "buffer"})


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
        ("data.csv", "a,b\n", "data.csv: unsupported file type"),
    ],
)
def test_bad_files_are_named(
    words: Tokenizer, tmp_path: Path, name: str, content: str | bytes, message: str
) -> None:
    path = _write(tmp_path / name, content)
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / message))):
        TextDataset(words, 4, path=path)


def test_error_in_a_nested_file_names_it(words: Tokenizer, tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    _write(tmp_path / "a.txt", "a b\n")
    _write(tmp_path / "sub" / "z.jsonl", '{"text": "a"}\n{"text": null}\n')
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'sub' / 'z.jsonl'}:2: field")):
        TextDataset(words, 4, path=str(tmp_path))


def test_missing_and_empty_paths_are_named(words: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nope.txt"))):
        TextDataset(words, 4, path=str(tmp_path / "nope.txt"))
    _write(tmp_path / "readme.md", "not data")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path}: no .txt or .jsonl files")):
        TextDataset(words, 4, path=str(tmp_path))


def test_bad_arguments(words: Tokenizer) -> None:
    with pytest.raises(ValueError, match="seq_len"):
        TextDataset(words, 0)
    with pytest.raises(ValueError, match="dp_rank"):
        TextDataset(words, 4, dp_rank=2, dp_world=2)
    with pytest.raises(ValueError, match="batch_size"):
        build_text_loader(words, 4, 0)
