"""Every source kind reads the same documents as the plain file they were written from, and
bad input is refused before training, naming the source (and row or byte offset)."""

from __future__ import annotations

import gzip
import itertools
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from temper.config import Config, ConfigError, DataSource
from temper.data import Tokenizer, text_dataset
from temper.data.loader import check_data_config
from temper.data.prepare import main as prepare_main
from temper.data.sources import open_source
from temper.data.sources.tokens import write_tokens

DOCS = ["a b c", "d e", "f g h i"]
# The three documents with EOS (0), cut in rows of 6 tokens sharing one (see test_data.py).
ROWS = [[1, 2, 3, 0, 4, 5], [5, 0, 6, 7, 8, 9], [9, 0, 1, 2, 3, 0], [0, 4, 5, 0, 6, 7]]


@pytest.fixture(scope="module")
def words() -> Tokenizer:
    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate("abcdefghi")}, "[UNK]": 10}
    raw = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(raw)


def _rows(tokenizer: Tokenizer, path: Path, field: str = "text") -> list[list[int]]:
    rows = itertools.islice(text_dataset(tokenizer, 5, path=str(path), text_field=field), 4)
    return [[*r["input_ids"].tolist(), r["labels"][-1].item()] for r in rows]


def _arrow_folder(folder: Path, table: pa.Table) -> Path:
    """The layout ``datasets.Dataset.save_to_disk`` writes: Arrow IPC stream files listed in
    state.json, beside dataset_info.json."""
    folder.mkdir()
    halves = [table.slice(0, 2), table.slice(2)]
    names = [f"data-{i:05d}-of-00002.arrow" for i in range(2)]
    for name, part in zip(names, halves, strict=True):
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, part.schema) as w:
            w.write_table(part)
    (folder / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": n} for n in names]})
    )
    (folder / "dataset_info.json").write_text("{}")
    return folder


def test_every_kind_reads_the_same_documents(words: Tokenizer, tmp_path: Path) -> None:
    table = pa.table({"id": [1, 2, 3], "body": DOCS})
    pq.write_table(table, tmp_path / "docs.parquet", row_group_size=1)  # 3 row groups
    lines = "".join(json.dumps({"body": d}) + "\n" for d in DOCS)
    (tmp_path / "docs.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    write_tokens(tmp_path / "docs.tokens", [words.encode(d) for d in DOCS], words.vocab_size)
    arrow = _arrow_folder(tmp_path / "arrow", table)
    for path in ("docs.parquet", "docs.jsonl.gz", "arrow"):
        assert _rows(words, tmp_path / path, "body") == ROWS, path
    assert _rows(words, tmp_path / "docs.tokens") == ROWS
    source = open_source(str(arrow))
    assert source.num_records == 3 and source.record(2) == {"id": 3, "body": "f g h i"}
    assert source.where(2) == f"{arrow} row 2"


def test_a_folder_of_parquet_shards_is_one_dataset(words: Tokenizer, tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"text": DOCS[:2]}), tmp_path / "data" / "train-00000.parquet")
    pq.write_table(pa.table({"text": DOCS[2:]}), tmp_path / "data" / "train-00001.parquet")
    assert _rows(words, tmp_path / "data") == ROWS


def test_the_prepare_command_writes_a_shard_that_trains_like_the_text(
    words: Tokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "corpus.txt").write_text("\n\n".join(DOCS) + "\n")
    (tmp_path / "tok").mkdir()
    words._tokenizer.save(str(tmp_path / "tok" / "tokenizer.json"))
    shard = tmp_path / "corpus.tokens"
    assert (
        prepare_main(
            [str(tmp_path / "corpus.txt"), str(shard), "--tokenizer", str(tmp_path / "tok")]
        )
        == 0
    )
    assert "wrote 3 documents" in capsys.readouterr().out
    assert _rows(words, shard) == _rows(words, tmp_path / "corpus.txt") == ROWS
    assert prepare_main([str(tmp_path / "missing.txt"), str(shard)]) == 2


def test_a_parquet_file_without_the_field_is_refused_at_open(
    words: Tokenizer, tmp_path: Path
) -> None:
    pq.write_table(pa.table({"body": DOCS}), tmp_path / "docs.parquet")
    message = f"{tmp_path / 'docs.parquet'}: no field 'text' (it has body)"
    with pytest.raises(ValueError, match=re.escape(message)):
        text_dataset(words, 5, path=str(tmp_path / "docs.parquet"))


def test_empty_sources_are_refused(words: Tokenizer, tmp_path: Path) -> None:
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    write_tokens(tmp_path / "empty.tokens", [], words.vocab_size)
    (tmp_path / "empty.jsonl.gz").write_bytes(gzip.compress(b"\n"))
    for name in ("empty.parquet", "empty.tokens", "empty.jsonl.gz"):
        with pytest.raises(ValueError, match=re.escape(f"{tmp_path / name}: no records")):
            text_dataset(words, 5, path=str(tmp_path / name))


def test_token_ids_beyond_the_vocabulary_name_the_byte_offset(
    words: Tokenizer, tmp_path: Path
) -> None:
    path = tmp_path / "big.tokens"
    write_tokens(path, [[1, 2], [3, 11, 4]], vocab_size=100)
    data_start = path.stat().st_size - 5 * 2  # five uint16 tokens end the file
    message = (
        f"{path}: token id 11 at byte offset {data_start + 3 * 2} is not below the vocabulary "
        f"size {words.vocab_size}"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        text_dataset(words, 5, path=str(path))
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(ValueError, match="truncated or overwritten"):
        open_source(str(path))


def test_an_unreadable_gzip_member_names_the_file(words: Tokenizer, tmp_path: Path) -> None:
    good = gzip.compress(b'{"text": "a b"}\n' * 50)
    (tmp_path / "cut.jsonl.gz").write_bytes(good[: len(good) // 2])
    with pytest.raises(
        ValueError, match=re.escape(f"{tmp_path / 'cut.jsonl.gz'}: not a readable gzip")
    ):
        text_dataset(words, 5, path=str(tmp_path / "cut.jsonl.gz"))


def test_mixing_config_errors_name_the_field(tmp_path: Path) -> None:
    config = Config()
    config.data.sources = [DataSource(path="a.jsonl"), DataSource(path="b.jsonl", weight=0.0)]
    with pytest.raises(ConfigError, match=r"data.sources.1.weight must be > 0, got 0.0"):
        check_data_config(config, 1)
    config.data.sources[1].weight = 1.0
    config.data.path = "c.jsonl"
    with pytest.raises(ConfigError, match="data.sources and data.path are both set"):
        check_data_config(config, 1)
    config.data.path = None
    config.validation.fraction = 1.5
    with pytest.raises(ConfigError, match=r"validation.fraction must be in \[0, 1\)"):
        check_data_config(config, 1)
