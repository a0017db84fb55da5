"""Formats by name: ``data.format`` picks a registered format, a user module can add one,
and a name nobody registered is refused naming the ones that are."""

from __future__ import annotations

import pytest
import torch

from temper.config import Config, ConfigError, Data, Training
from temper.data.checks import check_data_config
from temper.data.formats import FORMATS, FormatSpec, register_format
from temper.data.loader import build_loader
from temper.data.sources import ListSource
from temper.data.text import TextFormat
from temper.data.tokenizer import load_tokenizer


def test_an_unregistered_format_is_refused_naming_the_registered_ones() -> None:
    config = Config(data=Data(format="nope"))
    with pytest.raises(ConfigError, match=r"does not read data.format 'nope'"):
        config.validate(1)  # the objective's rule speaks first
    with pytest.raises(ConfigError, match=r"data.format 'nope' is not a registered format; "):
        check_data_config(config, 1)
    assert {"text", "sft", "preference", "prompt", "image_sft"} <= set(FORMATS.names())


def test_a_registered_format_feeds_the_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's format: text rows of its own built-in records, read by name."""
    monkeypatch.setattr(FORMATS, "_entries", dict(FORMATS._entries))  # dropped afterwards
    words = "alpha beta gamma delta"
    spec = FormatSpec(
        build=lambda config, tokenizer: TextFormat(tokenizer, config.training.seq_len),
        builtin=lambda config, split: ListSource([{"text": words}], f"words {split}"),
    )
    register_format("words", spec)
    tokenizer = load_tokenizer(None)
    config = Config(data=Data(format="words"), training=Training(seq_len=8, local_batch_size=1))
    batch = next(iter(build_loader(config, tokenizer, 0, 1)))
    stream = (tokenizer.encode(words) + [tokenizer.eos_id]) * 9
    assert torch.equal(batch["input_ids"][0], torch.tensor(stream[:8]))
    assert torch.equal(batch["labels"][0], torch.tensor(stream[1:9]))
    with pytest.raises(ValueError, match="data format 'words' is already registered"):
        register_format("words", spec)
