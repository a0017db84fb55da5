"""Packing with isolation: per-document positions and labels by hand, exact resumption, and
packed documents that compute exactly what each document computes alone."""

import itertools
from pathlib import Path

import pytest
import tokenizers
import torch
from tokenizers import models, pre_tokenizers
from torch import nn

from temper.data import BatchLoader, Tokenizer, build_text_loader, text_dataset
from temper.data.batch import IGNORE_INDEX, Batch
from temper.data.packing import document_labels, document_position_ids
from temper.kernels.attention import AttentionBackendError
from temper.models import build_model
from temper.objectives import CausalLM
from temper.objectives.causal_lm import documents

X = IGNORE_INDEX
EOS = 0


@pytest.fixture(scope="module")
def words() -> Tokenizer:
    """EOS = 0 and "a".."i" = 1..9, so rows can be written by hand."""
    vocab = {"<|endoftext|>": EOS, **{c: i + 1 for i, c in enumerate("abcdefghi")}, "[UNK]": 10}
    raw = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(raw)


@pytest.fixture
def txt_file(tmp_path: Path) -> str:
    path = tmp_path / "docs.txt"
    path.write_text("a b c\n\nd e\n\nf g h i\n")  # stream: 1 2 3 0 4 5 0 6 7 8 9 0, repeated
    return str(path)


def test_positions_and_labels_by_hand() -> None:
    ids = torch.tensor([[5, 0, 6, 7, 0, 0, 8], [0, 1, 2, 3, 4, 5, 6]])
    labels = torch.tensor([[0, 6, 7, 0, 0, 8, 9], [1, 2, 3, 4, 5, 6, 7]])
    assert document_position_ids(ids, EOS).tolist() == [
        [0, 1, 0, 1, 2, 0, 0],
        [0, 0, 1, 2, 3, 4, 5],
    ]
    assert document_labels(ids, labels, EOS).tolist() == [
        [0, X, 7, 0, X, X, 9],
        [X, 2, 3, 4, 5, 6, 7],
    ]


def test_isolated_rows_by_hand(words: Tokenizer, txt_file: str) -> None:
    plain = text_dataset(words, 5, path=txt_file)
    isolated = text_dataset(words, 5, path=txt_file, isolate_documents=True)
    expected = [  # rows 1 2 3 0 4 | 5, then 5 0 6 7 8 | 9, then 9 0 1 2 3 | 0
        ([2, 3, 0, X, 5], [0, 1, 2, 3, 0]),
        ([0, X, 7, 8, 9], [0, 1, 0, 1, 2]),
        ([0, X, 2, 3, 0], [0, 1, 0, 1, 2]),
    ]
    rows = zip(plain, isolated, expected, strict=False)
    for plain_row, row, (labels, positions) in rows:
        assert row.keys() == {"input_ids", "labels", "position_ids"}
        assert torch.equal(row["input_ids"], plain_row["input_ids"])
        assert row["labels"].tolist() == labels
        assert row["position_ids"].tolist() == positions
        assert row["position_ids"].dtype == torch.long


def test_isolated_restore_gives_the_next_batches(words: Tokenizer, txt_file: str) -> None:
    def loader() -> BatchLoader:
        return build_text_loader(words, 5, 2, path=txt_file, isolate_documents=True)

    reference = list(itertools.islice(loader(), 5))
    assert reference[0]["position_ids"].shape == (2, 5)
    interrupted = loader()
    batches = iter(interrupted)
    for _ in range(2):
        next(batches)
    restored = loader()
    restored.load_state_dict(interrupted.state_dict())
    for expected, got in zip(reference[2:], itertools.islice(restored, 3), strict=True):
        assert expected.keys() == got.keys()
        for key in expected:
            assert torch.equal(expected[key], got[key]), key


# Model checks: documents of random tokens closing with EOS, packed two rows of 24 tokens.
LENGTHS = ([7, 12, 5], [4, 9, 6, 5])


def _packed(docs: list[torch.Tensor]) -> Batch:
    """What the text format yields for a row that holds ``docs`` and then a next document."""
    stream = torch.cat([*docs, torch.tensor([3])])
    ids, labels = stream[:-1], stream[1:]
    return {
        "input_ids": ids[None],
        "labels": document_labels(ids, labels, EOS)[None],
        "position_ids": document_position_ids(ids, EOS)[None],
    }


def _batch(vocab: int) -> tuple[Batch, list[tuple[int, int, torch.Tensor]]]:
    """Two packed rows, and each document's (row, start, tokens)."""
    g = torch.Generator().manual_seed(0)
    rows = [
        [
            torch.cat([torch.randint(1, vocab, (n - 1,), generator=g), torch.tensor([EOS])])
            for n in row
        ]
        for row in LENGTHS
    ]
    packed = [_packed(row) for row in rows]
    batch = {key: torch.cat([p[key] for p in packed]) for key in packed[0]}
    spans = [
        (r, start, doc)
        for r, row in enumerate(rows)
        for start, doc in zip(itertools.accumulate(map(len, row), initial=0), row, strict=False)
    ]
    return batch, spans


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return build_model(name, "debug", device="cpu")


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_packed_document_losses_equal_each_document_alone(name: str) -> None:
    model = _model(name)
    vocab = model.tok_embeddings.num_embeddings
    batch, spans = _batch(vocab)
    objective = CausalLM()
    with torch.no_grad():
        for r, start, doc in spans:
            only_this = torch.full_like(batch["labels"], IGNORE_INDEX)
            end = start + len(doc)
            only_this[r, start:end] = batch["labels"][r, start:end]
            packed, n_packed, _ = objective.loss(model, {**batch, "labels": only_this})
            labels = document_labels(doc, torch.cat([doc[1:], doc[:1]]), EOS)
            alone, n_alone, _ = objective.loss(
                model, {"input_ids": doc[None], "labels": labels[None]}
            )
            assert n_packed == n_alone == len(doc) - 1
            torch.testing.assert_close(packed, alone, rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", ["llama3", "qwen3", "qwen3_moe"])
def test_a_document_never_sees_its_neighbours(name: str) -> None:
    model = _model(name)
    vocab = model.tok_embeddings.num_embeddings
    batch, spans = _batch(vocab)
    _, start, doc = spans[1]  # row 0: tokens [7, 19) hold document 1
    changed = batch["input_ids"].clone()
    changed[0, start : start + len(doc) - 1] = changed[0, start : start + len(doc) - 1] % 5 + 1
    with torch.no_grad():
        before = model(batch["input_ids"], batch["position_ids"], documents(batch))
        after = model(changed, batch["position_ids"], documents(batch))
    end = start + len(doc)
    torch.testing.assert_close(after[0, :start], before[0, :start], rtol=0, atol=1e-6)
    torch.testing.assert_close(after[0, end:], before[0, end:], rtol=0, atol=1e-6)
    torch.testing.assert_close(after[1], before[1], rtol=0, atol=1e-6)
    assert not torch.allclose(after[0, start:end], before[0, start:end])


def test_flex_model_forward_equals_sdpa_and_keeps_the_state_dict() -> None:
    model = _model("llama3")
    batch, _ = _batch(model.tok_embeddings.num_embeddings)
    keys = list(model.state_dict())
    docs = documents(batch)
    with torch.no_grad():
        expected = [
            model(batch["input_ids"], batch["position_ids"], docs),
            model(batch["input_ids"]),
        ]
        model.attn_backend = "flex"
        got = [model(batch["input_ids"], batch["position_ids"], docs), model(batch["input_ids"])]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    assert list(model.state_dict()) == keys


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only machine")
def test_training_with_flex_on_cpu_fails_before_any_layer() -> None:
    model = _model("llama3")
    model.attn_backend = "flex"
    batch, _ = _batch(model.tok_embeddings.num_embeddings)
    with pytest.raises(AttentionBackendError, match="'flex': FlexAttention has no backward on CPU"):
        CausalLM().loss(model, batch)
