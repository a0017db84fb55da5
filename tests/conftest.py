"""Every test starts from the library's default kernels: the references and full logits.

A Trainer configures its kernels process-wide (``configure_kernels``); without this reset a
test would inherit the choices of whichever Trainer test ran before it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import temper.engine  # noqa: F401  (registers every built-in config rule and objective)
from temper.kernels.dispatch import REFERENCE, configure_kernels

SUITE_ORDER = ("unit", "distributed", "integration")
"""Folders in the order their tests run: the fast unit tests first (a broken import shows in
seconds), the multi-process and end-to-end runs after, not alphabetically."""
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def folder_rank(item: pytest.Item) -> int:
        parts = item.path.resolve().relative_to(TESTS).parts
        return SUITE_ORDER.index(parts[0]) if parts[0] in SUITE_ORDER else len(SUITE_ORDER)

    items.sort(key=folder_rank)  # stable: the order within a folder stays pytest's


@pytest.fixture(autouse=True)
def reference_kernels() -> Iterator[None]:
    yield
    configure_kernels(REFERENCE, torch.device("cpu"))
