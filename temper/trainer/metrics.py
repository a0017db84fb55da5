"""Training metrics: one console line, TensorBoard scalars and metrics.jsonl, from rank 0."""

from __future__ import annotations

import json
import resource
import sys
import time
from collections import deque
from pathlib import Path
from typing import IO, Any

import torch


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
    ) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
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
        print(format_line(record, self.total_steps), file=sys.stdout, flush=True)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


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


HEADLINE_METRICS = ("val_loss", "reward_mean", "accuracy", "reward_accuracy", "reward_margin")
"""An objective's metrics that the console line shows after the loss when present (GRPO's
reward and sampled accuracy, DPO's reward accuracy and margin) and the validation loss: the
training loss alone says little."""


def format_line(record: dict[str, Any], total_steps: int | None = None) -> str:
    eta = record.get("eta_seconds", 0.0)
    step = f"{record['step']}/{total_steps}" if total_steps else str(record["step"])
    headline = "".join(f"{k} {record[k]:.3f}  " for k in HEADLINE_METRICS if k in record)
    return (
        f"step {step:>6}  loss {record['loss']:.4f}  {headline}"
        f"grad_norm {record['grad_norm']:.3f}  lr {record['lr']:.2e}  "
        f"tok/s {record['tokens_per_second']:,.0f}  tflops {record['tflops']:.2f}  "
        f"mfu {record['mfu']:.1f}%  mem {record['memory_gib']:.2f}GiB  "
        f"eta {time.strftime('%H:%M:%S', time.gmtime(eta))}"
    )


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: allocator peak on CUDA, max resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


ETA_WINDOW = 20
"""Steps the ETA's time per step is measured over: recent ones, so a slow first step
(compilation, warm-up) or a change of speed does not skew it for the rest of the run."""


class Throughput:
    """Tokens/s, TFLOP/s and MFU over the steps since the last log; the ETA from the time per
    step over about the last ``ETA_WINDOW`` steps."""

    def __init__(self, flops_per_token: float, peak_flops: float | None, total_steps: int) -> None:
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.total_steps = total_steps
        self._tokens = 0
        self._start = time.perf_counter()
        self._marks: deque[tuple[int, float]] = deque()

    def add_tokens(self, tokens: int) -> None:
        self._tokens += tokens

    def measure(self, step: int, first_step: int = 1) -> dict[str, float]:
        """Rates since the previous call; `step` is the last finished step."""
        now = time.perf_counter()
        elapsed = max(now - self._start, 1e-9)
        tokens_per_second = self._tokens / elapsed
        flops = self.flops_per_token * tokens_per_second
        if not self._marks:
            self._marks.append((first_step - 1, self._start))
        self._marks.append((step, now))
        while len(self._marks) > 2 and step - self._marks[1][0] >= ETA_WINDOW:
            self._marks.popleft()
        since_step, since = self._marks[0]
        per_step = (now - since) / max(step - since_step, 1)
        self._tokens, self._start = 0, now
        return {
            "tokens_per_second": tokens_per_second,
            "tflops": flops / 1e12,
            "mfu": 100.0 * flops / self.peak_flops if self.peak_flops else 0.0,
            "eta_seconds": per_step * (self.total_steps - step),
        }
