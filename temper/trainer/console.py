"""What a run says on the console besides its step lines: the model it built, where it
resumed, why it stopped, and a summary; and Ctrl-C as a request to stop at a step boundary."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType

import torch
from torch import nn

from temper.checkpoint.manager import checkpoint_dir, complete_steps, resolve_resume
from temper.config import Config
from temper.data.batch import IGNORE_INDEX, Batch
from temper.models.registry import spec_of
from temper.parallel.collectives import all_reduce_sum


def resolve_model_fields(config: Config, model: nn.Module) -> None:
    """Make ``model.name``/``model.flavor`` say what was built: with ``model.hf_path`` the
    folder's family and the folder's name (the recipe's defaults were ignored)."""
    if config.model.hf_path is not None:
        config.model.name = spec_of(model).name
        config.model.flavor = Path(config.model.hf_path).resolve().name


def startup_line(
    config: Config,
    model: nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    world: int,
    grad_accum: int,
) -> str:
    """The model actually built (family, size or HF folder, total and trainable
    parameters) and how it runs."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    source = f" from {config.model.hf_path}" if config.model.hf_path else ""
    return (
        f"temper: {config.model.name}/{config.model.flavor}{source}, "
        f"{_count(total)} params ({_count(trainable)} trainable) on {device} "
        f"({str(dtype).removeprefix('torch.')}), world {world}, grad accumulation {grad_accum}, "
        f"{config.training.steps} steps, run folder {config.job.dump_folder}"
    )


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def latest_checkpoint(root: Path) -> Path | None:
    steps = complete_steps(root)
    return checkpoint_dir(root, steps[-1]) if steps else None


def resumed_line(step: int, total: int, root: Path) -> str:
    return f"temper: resumed from step {step}/{total} ({checkpoint_dir(root, step)})"


def finished_step(config: Config) -> int | None:
    """The step of the checkpoint a run would resume from when it is at or past
    ``training.steps`` (nothing to train), else None: a look at the run folder (sizes, not
    digests), before anything is read or built. A checkpoint.resume that names no checkpoint
    is the pre-flight's to report."""
    if not config.checkpoint.enable:
        return None
    root = Path(config.job.dump_folder) / config.checkpoint.folder
    try:
        step = resolve_resume(root, config.checkpoint.resume, digests=False)
    except (OSError, ValueError):
        return None
    return step if step is not None and step >= config.training.steps else None


def complete_line(step: int, root: Path) -> str:
    return (
        f"temper: the run is already complete at step {step} ({checkpoint_dir(root, step)}); "
        "nothing to do (a new job.dump_folder or more training.steps trains again)"
    )


def stopped_line(step: int, root: Path, checkpointing: bool, cause: str = "Ctrl-C") -> str:
    latest = latest_checkpoint(root) if checkpointing else None
    if latest is not None:
        where = f"latest checkpoint {latest}; rerun the same command to resume"
    elif checkpointing:
        where = "no checkpoint saved yet (checkpoint.interval); a rerun starts again"
    else:
        where = "no checkpoint saved (--checkpoint.enable saves them)"
    return f"temper: stopped at step {step} on {cause}; {where}"


def summary_line(
    steps: int,
    seconds: float,
    counts: dict[str, int],
    loss: float | None,
    root: Path,
    checkpointing: bool,
) -> str:
    """The run's end: its steps and time, what it trained on in named units (``RunCounts``,
    summed over the data-parallel ranks), the last loss and the checkpoint to export."""
    latest = latest_checkpoint(root) if checkpointing else None
    saved = f"; checkpoint {latest}" if latest is not None else ""
    last = f", last loss {loss:.4f}" if loss is not None else ""
    spent = time.strftime("%H:%M:%S", time.gmtime(seconds))
    pairs = f", {counts['pairs']:,} pairs" if counts.get("pairs") else ""
    return (
        f"temper: done: {steps} steps in {spent}, {counts.get('trained_tokens', 0):,} tokens "
        f"trained, {counts.get('positions', 0):,} positions computed{pairs}{last}{saved}"
    )


class RunCounts:
    """What this process's steps trained on, counted on the host before a batch moves: the
    labelled tokens (``trained_tokens``), every position the model ran, padding included
    (``positions``, what ``computed_tokens_per_second`` counts), DPO pairs (``pairs``) and
    rows without a single label (``empty_label_rows``: they cost a forward and train
    nothing). Logged as ``data_<name>`` with the loader's counts, and named in the summary."""

    def __init__(self) -> None:
        self.local = {"trained_tokens": 0, "positions": 0, "pairs": 0, "empty_label_rows": 0}
        self.carried: dict[str, int] = {}
        """The run's totals at the checkpoint it resumed from (``TrainState`` keeps them)."""
        self._announced: set[str] = set()

    def add(self, batch: Batch) -> None:
        for key, value in batch.items():
            if key.endswith("input_ids"):
                self.local["positions"] += value.numel()
            if key.endswith("labels"):
                trained = (value != IGNORE_INDEX).flatten(1).sum(1)
                self.local["trained_tokens"] += int(trained.sum())
                self.local["empty_label_rows"] += int((trained == 0).sum())
        if "chosen_input_ids" in batch:
            self.local["pairs"] += batch["chosen_input_ids"].shape[0]

    def totals(self, summed: dict[str, int]) -> dict[str, int]:
        """``summed`` (this process's counts over the data ranks) plus the run's before a resume,
        so a resumed run logs what the uninterrupted one does."""
        return {name: value + self.carried.get(name, 0) for name, value in summed.items()}

    def notices(self, step: int, counts: dict[str, int], config: Config) -> list[str]:
        """One line for each of truncated, dropped and empty-label rows the first time its
        count (over all data-parallel ranks) is not zero, then nothing more for it."""
        policy = f"data.max_length_policy {config.data.max_length_policy}"
        limit = f"training.seq_len + 1 ({config.training.seq_len + 1} tokens)"
        why = {
            "truncated": f"samples cut to {limit} ({policy}; data_truncated)",
            "dropped": f"records skipped: longer than {limit} under {policy}, or with nothing "
            "to train on (data_dropped)",
            "empty_label_rows": "rows with no trained token, a forward for nothing "
            "(data_empty_label_rows)",
        }
        lines = []
        for name, what in why.items():
            if counts.get(name, 0) and name not in self._announced:
                self._announced.add(name)
                lines.append(f"temper: step {step}: {counts[name]:,} {what}")
        return lines


_STOPS = (signal.SIGINT, signal.SIGTERM)
"""The signals that ask for a stop at a step boundary, in the order of precedence."""


FORCED_EXIT_GRACE_S = 2.0
"""After a second Ctrl-C, how long the main thread has to raise KeyboardInterrupt (and clean
up) before the process exits anyway."""
SAME_PRESS_S = 1.0
"""SIGINTs this close together are one Ctrl-C: under torchrun a rank gets the terminal's and,
a moment later, the one its agent forwards."""


class StopRequest:
    """Inside the block, the first Ctrl-C (SIGINT) or SIGTERM only asks the loop to stop at
    the next step boundary; a second Ctrl-C interrupts at once (KeyboardInterrupt).

    Python runs a signal's handler only when the main thread runs Python code, so during one
    long operation (a forward, a backward, a collective) two Ctrl-C's would wait for it and
    count as one. A thread therefore reads every signal from ``signal.set_wakeup_fd`` as it
    arrives, and on the second Ctrl-C exits the process (130) if the main thread has not
    within ``FORCED_EXIT_GRACE_S``."""

    def __init__(self) -> None:
        self._previous: dict[int, object] = {}
        self._previous_fd = -1
        self._write_fd = -1
        self._left = threading.Event()
        self.signum = 0
        """The signal that asked to stop (0: none yet): this rank's, or once ``agreed`` any
        rank's."""

    def __enter__(self) -> StopRequest:
        self.signum = 0
        for sig in _STOPS:
            self._previous[sig] = signal.signal(sig, self._handle)
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._left = threading.Event()
        threading.Thread(target=self._watch, args=(read_fd, self._left), daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._left.set()
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._write_fd)  # the watcher reads the end of the pipe and returns
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    @staticmethod
    def _watch(read_fd: int, left: threading.Event) -> None:
        presses, last = 0, -SAME_PRESS_S
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while received := pipe.read(64):
                now = time.monotonic()
                if signal.SIGINT in received and now - last >= SAME_PRESS_S:
                    presses += 1
                    last = now
                if presses >= 2 and not left.wait(FORCED_EXIT_GRACE_S):
                    os.write(2, b"temper: interrupted\n")
                    os._exit(128 + signal.SIGINT)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    @property
    def cause(self) -> str:
        """What asked to stop: ``Ctrl-C``, ``SIGTERM`` (a scheduler, ``timeout``)."""
        return "Ctrl-C" if self.signum == signal.SIGINT else signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """A shell's code for a process that the signal ended: 130 (Ctrl-C), 143 (SIGTERM)."""
        return 128 + self.signum

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank was asked to stop, so every rank stops at the same step; each then
        knows the signal (SIGTERM where both came) and exits with the same code."""
        votes = torch.tensor([float(self.signum == sig) for sig in _STOPS], device=device)
        asked = [sig for sig, n in zip(_STOPS, all_reduce_sum(votes).tolist(), strict=True) if n]
        if asked:
            self.signum = asked[-1]
        return bool(asked)
