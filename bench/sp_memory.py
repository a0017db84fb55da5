"""Peak memory and time per rank of one training step under Ulysses sequence parallelism or
context parallelism (ring attention).

    python -m bench.sp_memory                          # llama3 debug, 8192 tokens, SP 1, 2, 4
    python -m bench.sp_memory --recipe qwen3_debug --seq-len 4096 --sp 1,2
    python -m bench.sp_memory --cp 1,2,4 --seq-len 4096,8192    # CP, two lengths

For each degree, that many gloo ranks (one thread each) train the recipe for two steps on
one row of ``--seq-len`` tokens, all ranks one SP (or CP) group (so parameters are sharded
over it too, as FSDP over ``dp_shard x cp x sp`` does). The first step warms up; each
rank's peak is its resident set's high-water mark during the second step (on CUDA the
allocator's peak) minus its resident set just before it: the memory that the step itself
adds, which is where the activations live. The table shows the largest rank's figure, and
the slowest rank's wall time of the second step. Degree 1 is the plain model.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.train_step import _peak_rss_gib, _reset_peak, _rss_gib


def _rank(recipe: str, seq_len: int, kind: str, degree: int, folder: str) -> tuple[float, float]:
    from temper.config import load_config
    from temper.trainer.trainer import Trainer

    argv = ["--job.dump_folder", folder, "--metrics.no_tensorboard", "--training.steps", "2"]
    argv += ["--training.seq_len", str(seq_len), "--training.local_batch_size", "1"]
    argv += [f"--parallelism.{kind}", str(degree), "--training.global_batch_size", "-1"]
    module = "temper.recipes.llama3" if recipe.startswith("llama3") else "temper.recipes.qwen3"
    trainer = Trainer(load_config(module, recipe, argv))
    batches = iter(trainer.loader)
    trainer.train_step([next(batches)])
    before = _rss_gib()
    _reset_peak(trainer.engine.device)
    start = time.perf_counter()
    trainer.train_step([next(batches)])
    return _peak_rss_gib() - before, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="llama3_debug")
    parser.add_argument("--seq-len", default="8192", help="comma-separated sequence lengths")
    parser.add_argument("--sp", default="1,2,4", help="comma-separated SP degrees")
    parser.add_argument("--cp", default=None, help="comma-separated CP degrees (instead of SP)")
    args = parser.parse_args()
    kind, degrees = ("sp", args.sp) if args.cp is None else ("cp", args.cp)
    # The tests' gloo launcher: N fresh processes, a failing or hung rank reported.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))
    from harness import run_on_ranks

    print(f"{args.recipe}, fp32 CPU, torch {torch.__version__}\n")
    print(
        f"| tokens | {kind.upper()} | peak memory added by one step, per rank (GiB) | "
        "vs the length's first row | step time (s) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: |", flush=True)
    for seq_len in map(int, args.seq_len.split(",")):
        first = None
        for degree in map(int, degrees.split(",")):
            with tempfile.TemporaryDirectory() as folder:
                ranks: list[Any] = run_on_ranks(
                    _rank, degree, args.recipe, seq_len, kind, degree, folder, timeout=3600.0
                )
            peak = max(p for p, _ in ranks)
            seconds = max(t for _, t in ranks)
            first = first or peak
            print(
                f"| {seq_len} | {degree} | {peak:.3f} | {peak / first:.2f}x | {seconds:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
