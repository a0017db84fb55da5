"""Every test starts from the library's default kernels: the references and full logits.

A Trainer configures its kernels process-wide (``configure_kernels``); without this reset a
test would inherit the choices of whichever Trainer test ran before it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import temper.engine  # noqa: F401  (registers every built-in config rule and objective)
from temper.kernels.dispatch import REFERENCE, configure_kernels


@pytest.fixture(autouse=True)
def reference_kernels() -> Iterator[None]:
    yield
    configure_kernels(REFERENCE, torch.device("cpu"))
