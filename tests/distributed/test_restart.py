"""MAX_RESTARTS: a rank killed mid-step; torchrun restarts the group, which resumes from the
newest complete checkpoint and trains on as the uninterrupted run did, bitwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dying_rank import KILL_STEP
from harness import run_on_ranks

from temper.config import Config, load_config

ROOT = Path(__file__).resolve().parents[2]
STEPS, INTERVAL = 6, 2
FLAGS = [
    "--training.steps", str(STEPS), "--training.seq_len", "32",
    "--training.local_batch_size", "2", "--training.deterministic",
    "--checkpoint.enable", "--checkpoint.interval", str(INTERVAL), "--metrics.no_tensorboard",
]  # fmt: skip


def read_rows(folder: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _train_rank(config: Config) -> list[dict[str, float]] | None:
    from temper.trainer import Trainer

    trainer = Trainer(config)
    trainer.train()
    return read_rows(Path(config.job.dump_folder)) if trainer.engine.runtime.is_main else None


@pytest.mark.slow
def test_killed_rank_restarts_and_continues_bitwise(tmp_path: Path) -> None:
    dump = tmp_path / "killed"
    env = {
        **os.environ,
        "TEMPER_PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
        ),
        "MODULE": "dying_rank",
        "CONFIG": "run",
        "NGPU": "2",
        "MAX_RESTARTS": "1",
    }
    result = subprocess.run(
        [str(ROOT / "run_train.sh"), *FLAGS, "--job.dump_folder", str(dump)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "exitcode: -9" in result.stderr  # torchrun saw rank 1 die of SIGKILL
    assert "temper: restart 1 after a rank failed" in result.stderr
    resumed_from = (KILL_STEP - 1) // INTERVAL * INTERVAL
    assert f"resumed from step {resumed_from}/{STEPS}" in result.stdout

    reference = load_config(
        "temper.recipes.llama3",
        "llama3_debug",
        [*FLAGS, "--job.dump_folder", str(tmp_path / "straight")],
    )
    straight = run_on_ranks(_train_rank, 2, reference)[0]
    rows = read_rows(dump)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert [row["loss"] for row in rows] == [row["loss"] for row in straight]
    assert [row["grad_norm"] for row in rows] == [row["grad_norm"] for row in straight]
