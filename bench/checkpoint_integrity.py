"""What the checkpoint's SHA-256 digests cost: save and load with and without them, in one run.

    python -m bench.checkpoint_integrity                     # 0.5 and 2 GiB of fp32 state
    python -m bench.checkpoint_integrity --gib 4 --rounds 3

A state of random fp32 tensors (64 MiB each, as a model's and an optimizer's are many
tensors) is saved with `CheckpointManager.save` and loaded with `CheckpointManager.load`,
each in rounds that alternate the two sides: `digests` (as Temper saves and loads: the
manifest records and checks every file's SHA-256) and `sizes` (the same code with the
digest replaced by the size check alone, what Temper did before). The ratio is digests
over sizes, per round, and the median. The files are in the page cache when they are read
back, as on a node that just wrote them; a cold read costs the disk's time on both sides.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch

import temper.checkpoint.integrity as integrity
import temper.checkpoint.manager as manager_module
from temper.checkpoint.manager import CheckpointManager

TENSOR_ELEMENTS = 16 << 20  # 64 MiB of fp32


@contextlib.contextmanager
def digests(enabled: bool) -> Iterator[None]:
    """Temper's manifest as it is, or with every SHA-256 left out (sizes only)."""
    if enabled:
        yield
        return

    def sizes_only(folder: Path, names: list[str]) -> dict[str, dict[str, int | str]]:
        return {name: {"size": (folder / name).stat().st_size} for name in names}

    with mock.patch.object(manager_module, "file_records", sizes_only):
        yield


def state_of(gib: float) -> dict[str, torch.Tensor]:
    count = max(1, round(gib * 2**30 / (TENSOR_ELEMENTS * 4)))
    generator = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(TENSOR_ELEMENTS, generator=generator) for i in range(count)}


def timed_save_and_load(
    root: Path, step: int, state: dict[str, torch.Tensor]
) -> tuple[float, float]:
    manager = CheckpointManager(root, keep_latest_k=1, async_mode=False)
    start = time.perf_counter()
    manager.save(step, {"state": state}, {"format": 1})
    saved = time.perf_counter() - start
    integrity._VERIFIED.clear()  # a fresh process: nothing verified yet
    target = {"state": {name: torch.empty_like(t) for name, t in state.items()}}
    start = time.perf_counter()
    manager.load(step, target)
    return saved, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, nargs="+", default=[0.5, 2.0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(
        "| state | round | save sizes (s) | save digests (s) | ratio | load sizes (s) | "
        "load digests (s) | ratio |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for gib in args.gib:
        state = state_of(gib)
        save_ratios, load_ratios = [], []
        with tempfile.TemporaryDirectory() as tmp:
            step = 0
            for round_ in range(1, args.rounds + 1):
                times = {}
                for enabled in (False, True) if round_ % 2 else (True, False):
                    step += 1
                    with digests(enabled):
                        times[enabled] = timed_save_and_load(Path(tmp), step, state)
                save_ratios.append(times[True][0] / times[False][0])
                load_ratios.append(times[True][1] / times[False][1])
                print(
                    f"| {gib:g} GiB | {round_} | {times[False][0]:.2f} | {times[True][0]:.2f} | "
                    f"{save_ratios[-1]:.2f}x | {times[False][1]:.2f} | {times[True][1]:.2f} | "
                    f"{load_ratios[-1]:.2f}x |"
                )
        print(
            f"| {gib:g} GiB | median | | | {statistics.median(save_ratios):.2f}x | | | "
            f"{statistics.median(load_ratios):.2f}x |"
        )


if __name__ == "__main__":
    main()
