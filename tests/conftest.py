"""The suite's folder order and the fixtures shared by every folder."""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import pytest
import tokenizers

import temper.engine  # noqa: F401  (registers every built-in config rule and objective)

SUITE_ORDER = ("unit", "distributed", "integration")
"""Folders in the order their tests run: the fast unit tests first (a broken import shows in
seconds), the multi-process and end-to-end runs after, not alphabetically."""
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def folder_rank(item: pytest.Item) -> int:
        parts = item.path.resolve().relative_to(TESTS).parts
        return SUITE_ORDER.index(parts[0]) if parts[0] in SUITE_ORDER else len(SUITE_ORDER)

    items.sort(key=folder_rank)  # stable: the order within a folder stays pytest's


def write_qwen_tokenizer(path: Path, chat_template: str) -> int:
    """The built-in tokenizer with Qwen's turn markers added, saved in ``path`` with
    ``chat_template``, as a Qwen-style HF folder holds it; its vocabulary size."""
    raw = tokenizers.Tokenizer.from_str(
        resources.files("temper.assets").joinpath("tokenizer.json").read_text()
    )
    raw.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    raw.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
        "chat_template": chat_template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return raw.get_vocab_size()


@pytest.fixture(scope="session")
def qwen_tokenizer() -> Callable[[Path, str], int]:
    """``write_qwen_tokenizer``, for tests in any folder."""
    return write_qwen_tokenizer
