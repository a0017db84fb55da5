"""run_train.sh's exit codes for a stop from outside: SIGTERM (a scheduler, ``timeout``) exits
143 with one process and under torchrun, as a shell reports a process that SIGTERM ended; the
run first stops at a step boundary and says so."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def stop_after_first_step(tmp_path: Path, ngpu: int, sig: signal.Signals) -> tuple[int, str]:
    """Launch a long run, send ``sig`` to the launcher alone once a step is logged, and return
    the exit code and the output."""
    env = {**os.environ, "TEMPER_PYTHON": sys.executable, "NGPU": str(ngpu)}
    args = ["--training.steps", "2000", "--job.dump_folder", str(tmp_path / "run")]
    run = subprocess.Popen(
        [str(ROOT / "run_train.sh"), *args, "--metrics.no-tensorboard"],
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
            run.send_signal(sig)
            break
    output = "".join(seen) + run.stdout.read()
    return run.wait(timeout=120), output


@pytest.mark.slow
@pytest.mark.parametrize("ngpu", [1, 2])
def test_sigterm_exits_143(tmp_path: Path, ngpu: int) -> None:
    code, output = stop_after_first_step(tmp_path, ngpu, signal.SIGTERM)
    assert code == 143, output
    assert re.search(r"temper: stopped at step \d+ on SIGTERM", output), output
    assert "Traceback" not in output, output


HOLD = (
    "import sys\n"
    "from temper.trainer.run_lock import RunLock\n"
    "RunLock(sys.argv[1]).acquire()\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n"
)


@pytest.mark.slow
def test_a_held_run_folder_under_torchrun_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """Two runs started at once pass the pre-flight together: the second's ranks refuse the
    folder themselves, and torchrun adds no failure report to rank 0's line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
    try:
        launch = [sys.executable, "-m", "temper.launch", "--standalone", "--nproc_per_node=2"]
        train = ["-m", "temper.train", "--training.steps", "2", "--job.dump_folder", str(run)]
        result = subprocess.run(
            [*launch, *train], env=env, capture_output=True, text=True, timeout=300
        )
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 2, result.stderr
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(
        f"temper: config error: job.dump_folder {run} is in use by another run (pid {holder.pid} "
    )
