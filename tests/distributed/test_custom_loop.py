"""examples/custom_loop.py, a loop written only against the Engine API, trains the same at
world 1 and under FSDP 2."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from harness import run_on_ranks

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_loop.py"
STEPS = 3


def _run_example(argv: list[str]) -> list[float]:
    spec = importlib.util.spec_from_file_location("custom_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def test_custom_loop_fsdp2_equals_one_process(tmp_path: Path) -> None:
    argv = ["--training.steps", str(STEPS), "--metrics.no_tensorboard"]
    alone = _run_example([*argv, "--job.dump_folder", str(tmp_path / "one")])
    sharded = run_on_ranks(_run_example, 2, [*argv, "--job.dump_folder", str(tmp_path / "two")])
    assert len(alone) == STEPS
    assert sharded[0] == sharded[1]  # every rank reports the global loss
    assert sharded[0] == pytest.approx(alone, rel=1e-5, abs=1e-7)
    assert len(set(alone)) == STEPS  # the policy moved: each step's loss differs
