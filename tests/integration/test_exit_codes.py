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
