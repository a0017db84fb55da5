"""``--profiling.trace_steps`` and ``--profiling.memory_snapshot_steps``: a torch.profiler trace
and, on CUDA, an allocator snapshot of chosen steps, one file per rank under the run folder."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

from temper.config import Profiling
from temper.utils import compat


class StepProfiler:
    """``with profiler.step(n): ...`` around the whole of step ``n`` (data to checkpoint).

    A traced step writes ``<dump_folder>/profile/step-<n>/rank<R>.<time>.pt.trace.json``, a
    Chrome trace that chrome://tracing, Perfetto and TensorBoard's profiler plugin
    (``tensorboard --logdir <dump_folder>/profile``) open. A snapshot step on CUDA writes
    ``<dump_folder>/memory_snapshot/step-<n>/rank<R>.pickle`` for pytorch.org/memory_viz;
    on another device it is skipped with one line saying so (the phases' peaks in
    metrics.jsonl are the CPU's view of memory).
    """

    def __init__(
        self, profiling: Profiling, dump_folder: str | Path, rank: int, device: torch.device
    ) -> None:
        self.settings = profiling
        self.folder = Path(dump_folder)
        self.rank = rank
        self.device = device
        self.trace_steps = set(profiling.trace_steps)
        self.snapshot_steps = set(profiling.memory_snapshot_steps)
        if self.snapshot_steps and device.type != "cuda":
            if rank == 0:
                print(
                    "temper: profiling.memory_snapshot_steps needs CUDA (the allocator's "
                    f"history); skipped on {device.type}: see mem_<phase>_gib in metrics.jsonl",
                    flush=True,
                )
            self.snapshot_steps = set()

    def trace_dir(self, step: int) -> Path:
        return self.folder / "profile" / f"step-{step}"

    def snapshot_path(self, step: int) -> Path:
        return self.folder / "memory_snapshot" / f"step-{step}" / f"rank{self.rank}.pickle"

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        snapshot = step in self.snapshot_steps
        if snapshot:
            compat.record_memory_history(True)
        tracer = self._tracer(step) if step in self.trace_steps else None
        try:
            if tracer is None:
                yield
            else:
                with tracer:
                    yield
        finally:
            if snapshot:
                path = self.snapshot_path(step)
                path.parent.mkdir(parents=True, exist_ok=True)
                compat.dump_memory_snapshot(str(path))
                compat.record_memory_history(False)

    def _tracer(self, step: int) -> profile:
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        s = self.settings
        return profile(
            activities=activities,
            record_shapes=s.record_shapes,
            profile_memory=s.profile_memory,
            with_stack=s.with_stack,
            on_trace_ready=tensorboard_trace_handler(
                str(self.trace_dir(step)), worker_name=f"rank{self.rank}"
            ),
        )
