"""torchao's low-bit AdamWs: their state's bytes against AdamW's, and training that tracks
AdamW's losses. (Their exact DCP resume is in tests/distributed/test_resume.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from temper.config import Optimizer
from temper.optim import build_optimizer, state_bytes
from temper.recipes.llama3 import llama3_debug
from temper.trainer import Trainer


@pytest.mark.parametrize(
    ("name", "ratio"), [("adamw8bit", 0.27), ("adamw4bit", 0.14), ("adamw_fp8", 0.26)]
)
def test_state_is_a_fraction_of_adamws(name: str, ratio: float) -> None:
    """A 256x256 matrix's two moments: 8 bytes a value in AdamW; 1 byte (4-bit: half) plus a
    4-byte scale per block of 256 (4-bit: 128) and a moment's fp32 codebook of 256 (4-bit: 16;
    fp8 has none) in the low-bit ones. The bias (256 values, under
    torchao's 4096-value minimum) keeps fp32 moments."""
    model = torch.nn.Linear(256, 256)
    sizes = {}
    for optimizer_name in ("adamw", name):
        optimizer = build_optimizer(model, Optimizer(name=optimizer_name))
        model(torch.randn(2, 256)).sum().backward()
        optimizer.step()
        sizes[optimizer_name] = state_bytes(optimizer)
    steps = 2 * 4  # each optimizer's fp32 step counters
    assert sizes["adamw"] == (256 * 256 + 256) * 8 + steps
    code_bytes = 256 * 256 * (0.5 if name == "adamw4bit" else 1)
    block = 128 if name == "adamw4bit" else 256
    codebook = {"adamw8bit": 256, "adamw4bit": 16, "adamw_fp8": 0}[name] * 4
    expected = 2 * (code_bytes + 256 * 256 / block * 4 + codebook) + 256 * 8 + steps
    assert sizes[name] == expected
    assert sizes[name] / sizes["adamw"] < ratio


def _losses(tmp_path: Path, name: str) -> list[float]:
    config = llama3_debug()
    config.job.dump_folder = str(tmp_path / name)
    config.training.steps = 20
    config.training.seq_len = 64
    config.training.local_batch_size = 4
    config.metrics.tensorboard = False
    config.optimizer.name = name
    Trainer(config).train()
    rows = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(row)["loss"] for row in rows]


@pytest.mark.slow
def test_adamw8bit_tracks_adamw(tmp_path: Path) -> None:
    """20 steps of the debug recipe (the loss falls from ~7.6 to ~4): every step's loss within
    2% of AdamW's, the 8-bit moments' rounding being the only difference."""
    reference = _losses(tmp_path, "adamw")
    low_bit = _losses(tmp_path, "adamw8bit")
    assert low_bit[0] == reference[0]  # the same start; the moments differ from step 1 on
    assert low_bit == pytest.approx(reference, rel=0.02)
    assert low_bit[-1] < reference[0] - 2.0
