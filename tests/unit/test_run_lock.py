"""One run per run folder: while a process holds ``<job.dump_folder>/.temper.lock`` the
pre-flight and the run itself refuse the folder in one line naming the holder; a holder that
died leaves the lock free; the Trainer holds it while it trains and lets go at the end."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from temper.config import ConfigError
from temper.train import main
from temper.trainer.run_lock import LOCK_FILE, RunLock, check_run_folder_free
from temper.trainer.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--training.steps", "2", "--training.seq_len", "16", "--metrics.no-tensorboard"]
HOLD = (
    "import sys\n"
    "from temper.trainer.run_lock import RunLock\n"
    "RunLock(sys.argv[1]).acquire()\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n"
)


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding ``tmp_path / 'run'``'s lock until the test ends."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-c", HOLD, str(tmp_path / "run")]
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    yield proc
    proc.kill()
    proc.wait()


def refusal(folder: Path, pid: int) -> str:
    return f"job.dump_folder {folder} is in use by another run (pid {pid} on {socket.gethostname()}"


def test_a_held_folder_is_refused_naming_the_holder(
    tmp_path: Path, holder: subprocess.Popen[str], capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    with pytest.raises(ConfigError) as error:
        RunLock(run).acquire()
    assert str(error.value).startswith(refusal(run, holder.pid) + ", started ")
    assert str(error.value).endswith(
        "): wait for it to end or stop it, or give this run its own --job.dump_folder"
    )
    capsys.readouterr()
    assert main(["--check_only", *TINY, "--job.dump_folder", str(run)]) == 2  # the pre-flight
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "temper: config error: " + refusal(run, holder.pid)
    )
    assert main([*TINY, "--job.dump_folder", str(run)]) == 2  # two runs started at once
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "temper: config error: " + refusal(run, holder.pid)
    )
    assert not (run / "metrics.jsonl").exists()


def test_a_dead_holders_lock_is_taken_over(tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    run = tmp_path / "run"
    holder.send_signal(signal.SIGKILL)  # no chance to release: the kernel frees the lock
    holder.wait()
    assert (run / LOCK_FILE).read_text().startswith(f"pid {holder.pid} ")
    lock = RunLock(run).acquire()
    assert (run / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} ")
    lock.release()
    assert (run / LOCK_FILE).read_text() == ""


def test_one_process_may_take_its_own_lock_again(tmp_path: Path) -> None:
    """A second Trainer in one process (a test, a notebook) shares the lock; the last release
    frees it."""
    first, second = RunLock(tmp_path).acquire(), RunLock(tmp_path).acquire()
    first.release()
    assert is_locked(tmp_path / LOCK_FILE)
    second.release()
    assert not is_locked(tmp_path / LOCK_FILE)


def test_pre_flights_looking_at_once_do_not_refuse_each_other(tmp_path: Path) -> None:
    """Every node of a multi-node run checks the shared run folder at the same moment: one
    node's look (a shared lock held right now) must not refuse another's, a run's must."""
    run = tmp_path / "run"
    check_run_folder_free(str(run))
    assert not run.exists()  # a look creates nothing
    RunLock(run).acquire().release()
    look = os.open(run / LOCK_FILE, os.O_RDONLY)
    try:
        fcntl.flock(look, fcntl.LOCK_SH | fcntl.LOCK_NB)
        check_run_folder_free(str(run))
    finally:
        os.close(look)


def test_the_trainer_holds_the_lock_while_it_trains(tmp_path: Path, monkeypatch) -> None:
    seen: list[bool] = []
    step = Trainer.train_step

    def step_and_look(self: Trainer, micro_batches):  # noqa: ANN001, ANN202
        seen.append(is_locked(tmp_path / LOCK_FILE))
        return step(self, micro_batches)

    monkeypatch.setattr(Trainer, "train_step", step_and_look)
    assert main([*TINY, "--job.dump_folder", str(tmp_path)]) == 0
    assert seen == [True, True]
    assert not is_locked(tmp_path / LOCK_FILE)


def is_locked(path: Path) -> bool:
    """Whether some holder has ``path`` locked: a new open file description conflicts with
    every other one, in this process too."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
