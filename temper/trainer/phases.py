"""Where a step's time and memory go: the loop's phases (data, rollout, forward, backward,
optimizer, checkpoint) as ``record_function`` ranges that a profiler trace shows, timed by
cheap wall-clock timers with each phase's peak memory, summed between log steps."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import record_function

from temper.trainer.metrics import peak_memory_gib

PHASES = ("data", "rollout", "forward", "backward", "optimizer", "checkpoint")
"""The phases the Trainer times; a nested phase (rollout inside data) counts only once."""


@dataclass
class _Open:
    """A phase in progress: when it began, time spent in phases nested in it, and the
    highest memory seen so far in it (before the peak counter was last reset)."""

    start: float
    nested: float = 0.0
    peak: float = 0.0


class PhaseTimer:
    """``with timer("forward"): ...`` times the block and records its peak memory.

    Times are exclusive (a nested phase's time is not its parent's), peaks inclusive. On CUDA
    a phase ends with a device synchronize, so its time is the device's, and the peak is the
    allocator's; on CPU the peak is the process's resident set (Linux's high-water mark,
    reset at each phase start), which includes more than tensors. ``enabled`` False keeps
    only the record-function ranges.
    """

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.device = device
        self.enabled = enabled
        self._open: list[_Open] = []
        self._seconds: dict[str, float] = defaultdict(float)
        self._peaks: dict[str, float] = {}
        self._steps = 0
        self.run_peak_gib = 0.0
        """The highest phase peak since the start: the run's peak, which the resets of the
        peak counter hide from ``peak_memory_gib``."""

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        with record_function(f"temper.{name}"):
            if not self.enabled:
                yield
                return
            if self._open:  # the parent's peak so far, before the reset below loses it
                self._open[-1].peak = max(self._open[-1].peak, peak_memory_gib(self.device))
            reset_peak(self.device)
            phase = _Open(time.perf_counter())
            self._open.append(phase)
            try:
                yield
            finally:
                self._open.pop()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                elapsed = time.perf_counter() - phase.start
                peak = max(phase.peak, peak_memory_gib(self.device))
                self._seconds[name] += elapsed - phase.nested
                self._peaks[name] = max(self._peaks.get(name, 0.0), peak)
                self.run_peak_gib = max(self.run_peak_gib, peak)
                if self._open:
                    self._open[-1].nested += elapsed
                    self._open[-1].peak = max(self._open[-1].peak, peak)

    def step_done(self) -> None:
        """Count one step, the unit ``summary`` divides times by."""
        self._steps += 1

    def summary(self) -> dict[str, float]:
        """``time_<phase>_ms`` (mean per step) and ``mem_<phase>_gib`` (peak) of each phase
        seen since the last summary, which starts the next window."""
        steps = max(self._steps, 1)
        out = {f"time_{name}_ms": 1e3 * s / steps for name, s in self._seconds.items()}
        out |= {f"mem_{name}_gib": peak for name, peak in self._peaks.items()}
        self._seconds.clear()
        self._peaks.clear()
        self._steps = 0
        return out


_CLEAR_REFS = Path("/proc/self/clear_refs")


def reset_peak(device: torch.device) -> None:
    """Start a new peak: the allocator's on CUDA; on Linux the resident set's high-water mark
    (writing 5 to clear_refs resets ``VmHWM`` to the current resident set); where that is
    refused the CPU peak stays the run's."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with suppress(OSError):
        _CLEAR_REFS.write_text("5")
