"""The resume matrix: pretraining on a text file, packed SFT, DPO with a frozen reference and
DPO with LoRA, each resumed from its step-2 checkpoint, equal the uninterrupted run: bitwise
in the same layout (one process), within 1e-5 at FSDP 2, and at the same data position.

The uninterrupted run saves every 2 steps; its step-2 checkpoint, copied into a fresh run
folder, is what a run killed after step 2 leaves behind (saving does not change training).
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from harness import run_on_ranks

from temper.config import Config
from temper.recipes.llama3 import llama3_debug
from temper.recipes.posttrain import dpo_debug, sft_debug

STEPS, SAVED, GLOBAL_BATCH = 4, 2, 4
COMPARED = ("loss", "grad_norm", "lr", "reward_accuracy", "reward_margin")
"""The metrics of a row that must continue; the rest are timings."""


def text_file(folder: Path) -> Path:
    """A small pretraining corpus, one document a line."""
    rng = random.Random(0)
    words = ["temper", "resume", "shard", "token", "step", "loss", "rank", "batch", "data"]
    path = folder / "corpus.txt"
    lines = (" ".join(rng.choices(words, k=rng.randint(5, 40))) for _ in range(200))
    path.write_text("\n".join(lines) + "\n")
    return path


def pretrain_text(folder: Path) -> Config:
    config = llama3_debug()
    config.data.path = str(text_file(folder))
    return config


def packed_sft(folder: Path) -> Config:
    config = sft_debug()
    assert config.data.pack
    return config


def dpo_frozen_reference(folder: Path) -> Config:
    config = dpo_debug()
    config.lora.enable = False
    return config


def dpo_lora(folder: Path) -> Config:
    config = dpo_debug()
    assert config.lora.enable
    return config


CASES: dict[str, Callable[[Path], Config]] = {
    "pretrain_text": pretrain_text,
    "packed_sft": packed_sft,
    "dpo_frozen_reference": dpo_frozen_reference,
    "dpo_lora": dpo_lora,
}


def shortened(config: Config, dump: Path, world: int) -> Config:
    config.job.dump_folder = str(dump)
    config.training.steps = STEPS
    config.training.seq_len = min(config.training.seq_len, 48)
    config.training.local_batch_size = GLOBAL_BATCH // world
    config.training.global_batch_size = GLOBAL_BATCH
    config.training.deterministic = True
    config.data.builtin_examples = 64
    config.metrics.tensorboard = False
    config.checkpoint.enable = True
    config.checkpoint.interval = SAVED
    return config


def _train_rank(config: Config) -> dict[str, Any] | None:
    from temper.trainer import Trainer

    trainer = Trainer(config)
    resumed_from = trainer.state.step
    trainer.train()
    # Every lane's position, gathered from all ranks (what a checkpoint holds): the same at
    # any layout, where one rank's loader state holds only its lanes.
    data = trainer.state.state_dict()["dataloader"]
    if not trainer.engine.runtime.is_main:
        return None
    rows = (Path(config.job.dump_folder) / "metrics.jsonl").read_text().splitlines()
    return {
        "rows": [json.loads(line) for line in rows],
        "resumed_from": resumed_from,
        "data": data,
        "tokens_seen": trainer.state.tokens_seen,
    }


def train(config: Config, world: int) -> dict[str, Any]:
    return run_on_ranks(_train_rank, world, config)[0]


def from_saved(straight: Path, dump: Path) -> None:
    """A run folder holding only the straight run's step-SAVED checkpoint."""
    name = f"checkpoints/step-{SAVED}"
    shutil.copytree(straight / name, dump / name)


def compared(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: row[k] for k in ("step", *COMPARED) if k in row} for row in rows]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_resume_continues_the_uninterrupted_run(tmp_path: Path, case: str) -> None:
    recipe = CASES[case]
    straight = train(shortened(recipe(tmp_path), tmp_path / "straight", 1), 1)
    expected = compared(straight["rows"])[SAVED:]
    assert [row["step"] for row in expected] == list(range(SAVED + 1, STEPS + 1))

    from_saved(tmp_path / "straight", tmp_path / "same")
    same = train(shortened(recipe(tmp_path), tmp_path / "same", 1), 1)
    assert same["resumed_from"] == SAVED
    assert compared(same["rows"]) == expected  # bitwise: the same layout, deterministic
    assert same["data"] == straight["data"]
    assert same["tokens_seen"] == straight["tokens_seen"]

    from_saved(tmp_path / "straight", tmp_path / "fsdp2")
    fsdp2 = train(shortened(recipe(tmp_path), tmp_path / "fsdp2", 2), 2)
    assert fsdp2["resumed_from"] == SAVED
    for row, want in zip(compared(fsdp2["rows"]), expected, strict=True):
        # DPO's margin is a difference of summed log-probabilities, small against each of
        # them: its rounding is relative to those sums, so it is held to 1e-5 absolute.
        assert row.keys() == want.keys()
        for name, value in want.items():
            tolerance = {"abs": 1e-5} if name == "reward_margin" else {"rel": 1e-5}
            assert row[name] == pytest.approx(value, **tolerance), f"step {row['step']} {name}"
    assert fsdp2["tokens_seen"] == straight["tokens_seen"]
    assert fsdp2["data"] == straight["data"]  # no row seen twice or skipped
