"""Training metrics: one console line, TensorBoard scalars and metrics.jsonl, from rank 0."""

from __future__ import annotations

import json
import resource
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import IO, Any

import torch

from temper.trainer.loggers import StepLogger


class MetricsLogger:
    """Writes each logged step to the console, `<dump>/tb` and `<dump>/metrics.jsonl`."""

    def __init__(
        self,
        dump_folder: str | Path,
        *,
        tensorboard: bool,
        enabled: bool,
        resume_step: int = 0,
        total_steps: int | None = None,
        loggers: Sequence[StepLogger] = (),
    ) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        self.loggers = list(loggers)
        """W&B / MLflow (``temper.trainer.loggers``): each logged row goes to them too."""
        self._jsonl: IO[str] | None = None
        self._tb = None
        if not enabled:
            return
        folder = Path(dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._jsonl = _open_metrics(folder / "metrics.jsonl", resume_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(folder / "tb"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record: dict[str, Any] = {"step": step, **metrics}
        assert self._jsonl is not None
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for name, value in metrics.items():
                self._tb.add_scalar(name, value, step)
        for logger in self.loggers:
            logger.log(step, metrics)
        print(format_line(record, self.total_steps), file=sys.stdout, flush=True)

    def log_image(self, name: str, image: Any, step: int) -> None:
        """An RGB image [height, width, 3] (uint8) to TensorBoard, when it is on."""
        if self._tb is not None:
            self._tb.add_image(name, image, step, dataformats="HWC")

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        for logger in self.loggers:
            logger.close()


def _open_metrics(path: Path, resume_step: int) -> IO[str]:
    """A fresh file, or on resume the rows up to the resumed step (a crashed run may have
    logged steps after its last checkpoint; they are run again)."""
    kept = []
    if resume_step > 0 and path.exists():
        kept = [
            line
            for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= resume_step
        ]
    handle = path.open("w")
    handle.writelines(line + "\n" for line in kept)
    handle.flush()
    return handle


HEADLINE_METRICS = {
    "val_loss": ".3f",
    "reward_mean": ".3f",
    "accuracy": ".3f",
    "kl": ".2e",
    "clip_fraction": ".3f",
    "reward_accuracy": ".3f",
    "reward_margin": ".3f",
}
"""An objective's metrics that the console line shows after the loss when present, with
their format (GRPO's reward, sampled accuracy, KL and clip fraction, DPO's reward accuracy
and margin) and the validation loss: the training loss alone says little (GRPO's is about 0
on every first update, where the ratio is 1 and the advantages are centred)."""


def format_line(record: dict[str, Any], total_steps: int | None = None) -> str:
    eta = record.get("eta_seconds", 0.0)
    step = f"{record['step']}/{total_steps}" if total_steps else str(record["step"])
    headline = "".join(
        f"{k} {record[k]:{form}}  " for k, form in HEADLINE_METRICS.items() if k in record
    )
    return (
        f"step {step:>6}  loss {record['loss']:.4f}  {headline}"
        f"grad_norm {record['grad_norm']:.3f}  lr {record['lr']:.2e}  "
        f"tok/s {record['tokens_per_second']:,.0f} of {record['computed_tokens_per_second']:,.0f}"
        f" (packing {record['packing_efficiency']:.1f}%)  tflops {record['tflops']:.2f}  "
        f"mfu {record['mfu']:.1f}%  mem {record['memory_gib']:.2f}GiB  "
        f"eta {time.strftime('%H:%M:%S', time.gmtime(eta))}"
    )


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process since the start (or the last
    ``temper.trainer.phases.reset_peak``): allocator peak on CUDA, max resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resident_peak_gib()


_STATUS = Path("/proc/self/status")


def resident_peak_gib() -> float:
    """The resident set's high-water mark: Linux's ``VmHWM``, which is this process's own.
    ``ru_maxrss`` is not: a process started by fork and exec inherits its parent's resident
    set there (a trainer started from a large test process reads the parent's size), and
    resetting the mark leaves it. Elsewhere (no /proc), ``ru_maxrss``, in KiB on Linux."""
    if _STATUS.exists():
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


ETA_WINDOW = 20
"""Steps the ETA's time per step is measured over: recent ones, so a slow first step
(compilation, warm-up) or a change of speed does not skew it for the rest of the run."""


class Throughput:
    """Tokens/s, TFLOP/s and MFU of the real (non-padding) tokens over the steps since the
    last log, beside the positions computed and their ratio (``packing_efficiency``, %); the
    ETA from the time per step over about the last ``ETA_WINDOW`` steps."""

    def __init__(
        self, flops_per_token: Callable[[int], float], peak_flops: float | None, total_steps: int
    ) -> None:
        self.flops_per_token = cache(flops_per_token)
        """Training FLOPs per token of a row of the given width (the model's own count)."""
        self.peak_flops = peak_flops
        self.total_steps = total_steps
        self._tokens = 0.0
        self._positions = 0
        self._flops = 0.0
        self._start = time.perf_counter()
        self._marks: deque[tuple[int, float]] = deque()

    def add_rows(self, rows: int, width: int, real_share: float = 1.0) -> None:
        """``rows`` rows of ``width`` positions ran, ``real_share`` of them real tokens (the
        rest padding, computed for nothing): tokens/s and the model FLOPs count the real ones
        only, each at the FLOPs per token of a row this wide (attention's share)."""
        real = rows * width * real_share
        self._tokens += real
        self._positions += rows * width
        self._flops += real * self.flops_per_token(width)

    def measure(self, step: int, first_step: int = 1) -> dict[str, float]:
        """Rates since the previous call; `step` is the last finished step."""
        now = time.perf_counter()
        elapsed = max(now - self._start, 1e-9)
        tokens_per_second = self._tokens / elapsed
        flops = self._flops / elapsed
        if not self._marks:
            self._marks.append((first_step - 1, self._start))
        self._marks.append((step, now))
        while len(self._marks) > 2 and step - self._marks[1][0] >= ETA_WINDOW:
            self._marks.popleft()
        since_step, since = self._marks[0]
        per_step = (now - since) / max(step - since_step, 1)
        efficiency = 100.0 * self._tokens / self._positions if self._positions else 100.0
        computed_per_second = self._positions / elapsed
        self._tokens, self._positions, self._flops, self._start = 0.0, 0, 0.0, now
        return {
            "tokens_per_second": tokens_per_second,
            "computed_tokens_per_second": computed_per_second,
            "packing_efficiency": efficiency,
            "tflops": flops / 1e12,
            "mfu": 100.0 * flops / self.peak_flops if self.peak_flops else 0.0,
            "eta_seconds": per_step * (self.total_steps - step),
        }
