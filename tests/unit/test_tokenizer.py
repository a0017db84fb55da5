import json
import re
from importlib import resources
from pathlib import Path

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from temper.assets.make_tokenizer import SPECIAL_TOKENS, build_tokenizer
from temper.data import Tokenizer, load_tokenizer, synthetic_document

ASSET = Path(str(resources.files("temper.assets").joinpath("tokenizer.json")))


def _asset_added_ids() -> dict[str, int]:
    """Special-token ids as written in the shipped file: the reference for the wrapper."""
    return {
        token["content"]: token["id"] for token in json.loads(ASSET.read_text())["added_tokens"]
    }


def _word_tokenizer(vocab: dict[str, int]) -> tokenizers.Tokenizer:
    raw = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return raw


def test_builtin_special_tokens_and_size() -> None:
    tokenizer = load_tokenizer(None)
    added = _asset_added_ids()
    assert list(added) == list(SPECIAL_TOKENS)
    assert tokenizer.eos_id == added["<|endoftext|>"]
    assert tokenizer.pad_id == added["<|pad|>"]
    for token, token_id in added.items():
        assert tokenizer.encode(token) == [token_id]
        assert tokenizer.encode(f"12 + 3{token}copy").count(token_id) == 1
    vocab = json.loads(ASSET.read_text())["model"]["vocab"]
    assert tokenizer.vocab_size == len(vocab) == max(vocab.values()) + 1
    assert tokenizer.vocab_size <= 2048


def test_encode_adds_no_special_tokens() -> None:
    tokenizer = load_tokenizer(None)
    ids = tokenizer.encode("1 + 2 = 3")
    assert not set(ids) & set(_asset_added_ids().values())


@pytest.mark.parametrize(
    "text",
    [
        synthetic_document(0, 0),
        synthetic_document(7, 123),
        "héllo wörld — 日本語 🙂 Ωμέγα\n\ttabs  and   spaces\r\n",
        "  leading space, <|user|> marker and trailing newline\n\n",
        "",
    ],
)
def test_round_trip(text: str) -> None:
    tokenizer = load_tokenizer(None)
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_synthetic_text_compresses() -> None:
    """The vocabulary was trained on the synthetic tasks, so they need few tokens per byte."""
    tokenizer = load_tokenizer(None)
    text = "\n".join(synthetic_document(0, i) for i in range(50))
    assert len(tokenizer.encode(text)) < len(text.encode()) / 2


def test_shipped_asset_matches_make_tokenizer() -> None:
    # Both go through the installed `tokenizers` serializer, so the check is about content,
    # not the file format of the version that wrote the asset.
    shipped = tokenizers.Tokenizer.from_file(str(ASSET))
    assert json.loads(build_tokenizer().to_str()) == json.loads(shipped.to_str())


def test_load_directory_eos_from_config(tmp_path: Path) -> None:
    ids = _asset_added_ids()
    (tmp_path / "tokenizer.json").write_text(ASSET.read_text())
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"eos_token": "<|end|>"}))
    assert load_tokenizer(str(tmp_path)).eos_id == ids["<|end|>"]
    config.write_text(json.dumps({"eos_token": {"content": "<|user|>"}, "pad_token": None}))
    tokenizer = load_tokenizer(str(tmp_path))
    assert (tokenizer.eos_id, tokenizer.pad_id) == (ids["<|user|>"], ids["<|pad|>"])
    config.unlink()
    assert load_tokenizer(str(tmp_path)).eos_id == ids["<|endoftext|>"]


def test_load_file_and_foreign_vocab(tmp_path: Path) -> None:
    raw = _word_tokenizer({"[UNK]": 0, "a": 1, "b": 2, "</s>": 3})
    raw.add_special_tokens(["<|pad|>"])
    raw.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"tokenizer\.json: no EOS token"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tokenizer = load_tokenizer(str(tmp_path))
    assert (tokenizer.eos_id, tokenizer.pad_id, tokenizer.vocab_size) == (3, 4, 5)
    assert tokenizer.encode("b a b") == [2, 1, 2]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    with pytest.raises(ValueError, match=r"tokenizer\.json: token '<eos>' is not in"):
        load_tokenizer(str(tmp_path))


def test_load_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "tokenizer.json"))):
        load_tokenizer(str(tmp_path))
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_tokenizer(str(missing))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match=re.escape(f"{broken}: not a valid tokenizer.json")):
        load_tokenizer(str(broken))
    (tmp_path / "tokenizer.json").write_text(ASSET.read_text())
    (tmp_path / "tokenizer_config.json").write_text("{")
    with pytest.raises(
        ValueError, match=re.escape(f"{tmp_path / 'tokenizer_config.json'}: invalid")
    ):
        load_tokenizer(str(tmp_path))


def test_wrapper_rejects_unknown_eos() -> None:
    with pytest.raises(ValueError, match="'<eos>' is not in"):
        Tokenizer(_word_tokenizer({"[UNK]": 0, "a": 1}), eos_token="<eos>")
