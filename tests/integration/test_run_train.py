"""run_train.sh end to end: the default recipe learns, user modules launch, errors exit early."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_train(
    args: list[str], cwd: Path, env: dict[str, str] | None = None, ngpu: int = 1
) -> subprocess.CompletedProcess[str]:
    """Launch run_train.sh with this interpreter (no venv bootstrap inside the test)."""
    full_env = {**os.environ, "TEMPER_PYTHON": sys.executable, "NGPU": str(ngpu), **(env or {})}
    return subprocess.run(
        [str(ROOT / "run_train.sh"), *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def read_metrics(folder: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_default_recipe_learns(tmp_path: Path) -> None:
    dump = tmp_path / "run"
    result = run_train(
        ["--training.steps", "30", "--job.dump_folder", str(dump), "--training.seq_len", "128"],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(dump)
    assert [row["step"] for row in rows] == list(range(1, 31))
    required = {"loss", "grad_norm", "lr", "tokens_per_second", "tflops", "mfu", "memory_gib"}
    assert required <= rows[0].keys()
    first, last = rows[0]["loss"], rows[-1]["loss"]
    assert last <= first * 2 / 3, f"loss fell only from {first:.3f} to {last:.3f}"
    saved = json.loads((dump / "config.json").read_text())
    assert saved["training"]["steps"] == 30 and saved["model"]["flavor"] == "debug"
    assert any((dump / "tb").iterdir())


def _documented_user_module() -> str:
    """The example module of docs/recipes.md, so the docs cannot drift from what works."""
    text = (ROOT / "docs" / "recipes.md").read_text()
    block = re.search(r"```python\n(# my_recipes\.py\n.*?)```", text, re.DOTALL)
    assert block is not None, "docs/recipes.md lost its my_recipes.py example"
    return block.group(1)


@pytest.mark.slow
def test_user_module_from_the_docs(tmp_path: Path) -> None:
    (tmp_path / "my_recipes.py").write_text(_documented_user_module())
    dump = tmp_path / "outputs" / "mine"
    result = run_train(
        ["--training.steps", "3", "--training.eval_every", "10", "--job.dump_folder", str(dump)],
        cwd=tmp_path,
        env={"MODULE": "my_recipes", "CONFIG": "my_run"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads((dump / "config.json").read_text())
    assert saved["training"]["eval_every"] == 10
    assert saved["training"]["seq_len"] == 128 and saved["optimizer"]["lr"] == 1e-3
    assert [row["step"] for row in read_metrics(dump)] == [1, 2, 3]


def test_unknown_flag_fails_before_training(tmp_path: Path) -> None:
    result = run_train(
        ["--training.stepz", "3", "--job.dump_folder", str(tmp_path / "x")], tmp_path
    )
    assert result.returncode != 0
    assert "--training.stepz" in result.stdout + result.stderr
    assert not (tmp_path / "x").exists()


def test_missing_recipe_names_the_choices(tmp_path: Path) -> None:
    result = run_train([], tmp_path, env={"CONFIG": "llama3_tiny"})
    assert result.returncode != 0
    assert "no recipe function 'llama3_tiny'" in result.stderr
    assert "llama3_debug" in result.stderr


def test_help_lists_every_section(tmp_path: Path) -> None:
    result = run_train(["--help"], tmp_path)
    assert result.returncode == 0
    for flag in ("--training.global_batch_size", "--optimizer.lr", "--data.path"):
        assert flag in result.stdout


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path: Path) -> None:
    """Data parallel over 2 gloo ranks equals one rank doing both halves of the batch."""
    common = ["--training.steps", "3", "--training.seq_len", "64", "--metrics.no_tensorboard"]
    one = run_train(
        [
            *common,
            "--training.local_batch_size",
            "4",
            "--training.global_batch_size",
            "4",
            "--job.dump_folder",
            str(tmp_path / "one"),
        ],
        tmp_path,
    )
    two = run_train(
        [
            *common,
            "--training.local_batch_size",
            "2",
            "--training.global_batch_size",
            "4",
            "--job.dump_folder",
            str(tmp_path / "two"),
        ],
        tmp_path,
        ngpu=2,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    for a, b in zip(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two"), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


@pytest.mark.slow
def test_ctrl_c_under_torchrun_stops_with_one_line(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the terminal's process group) with two ranks: the run stops at a
    step boundary and says so; torchrun's agent adds no traceback or shutdown notices."""
    import signal

    env = {**os.environ, "TEMPER_PYTHON": sys.executable, "NGPU": "2"}
    args = ["--training.steps", "2000", "--job.dump_folder", str(tmp_path / "run")]
    run = subprocess.Popen(
        [str(ROOT / "run_train.sh"), *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert run.stdout is not None
    seen = []
    for line in run.stdout:
        seen.append(line)
        if line.startswith("step "):
            os.killpg(run.pid, signal.SIGINT)
            break
    output = "".join(seen) + run.stdout.read()
    assert run.wait(timeout=120) == 128 + signal.SIGINT, output
    assert re.search(r"temper: stopped at step \d+ on Ctrl-C", output), output
    for noise in ("Traceback", "SignalException", "death signal", "OMP_NUM_THREADS"):
        assert noise not in output, output
