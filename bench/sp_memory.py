"""Peak memory per rank of one training step under Ulysses sequence parallelism.

    python -m bench.sp_memory                          # llama3 debug, 8192 tokens, SP 1, 2, 4
    python -m bench.sp_memory --recipe qwen3_debug --seq-len 4096 --sp 1,2

For each SP degree, that many gloo ranks (one thread each) train the recipe for two steps on
one row of ``--seq-len`` tokens, all ranks one SP group (so parameters are sharded over it
too, as FSDP over ``dp_shard x sp`` does). The first step warms up; each rank's peak is its
resident set's high-water mark during the second step (on CUDA the allocator's peak)
minus its resident set just before it: the memory that the step itself adds, which is
where the activations live. The table shows the largest rank's figure.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.train_step import _peak_rss_gib, _reset_peak, _rss_gib


def _rank(recipe: str, seq_len: int, sp: int, folder: str) -> float:
    from temper.config import load_config
    from temper.trainer.trainer import Trainer

    argv = ["--job.dump_folder", folder, "--metrics.no_tensorboard", "--training.steps", "2"]
    argv += ["--training.seq_len", str(seq_len), "--training.local_batch_size", "1"]
    argv += ["--parallelism.sp", str(sp), "--training.global_batch_size", "-1"]
    module = "temper.recipes.llama3" if recipe.startswith("llama3") else "temper.recipes.qwen3"
    trainer = Trainer(load_config(module, recipe, argv))
    batches = iter(trainer.loader)
    trainer.train_step([next(batches)])
    before = _rss_gib()
    _reset_peak(trainer.engine.device)
    trainer.train_step([next(batches)])
    return _peak_rss_gib() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="llama3_debug")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--sp", default="1,2,4", help="comma-separated SP degrees")
    args = parser.parse_args()
    # The tests' gloo launcher: N fresh processes, a failing or hung rank reported.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))
    from harness import run_on_ranks

    print(f"{args.recipe}, {args.seq_len} tokens, fp32 CPU, torch {torch.__version__}\n")
    print("| SP | peak memory added by one step, per rank (GiB) | vs the first row |")
    print("| ---: | ---: | ---: |", flush=True)
    first = None
    for sp in map(int, args.sp.split(",")):
        with tempfile.TemporaryDirectory() as folder:
            peaks: list[Any] = run_on_ranks(
                _rank, sp, args.recipe, args.seq_len, sp, folder, timeout=3600.0
            )
        first = first or max(peaks)
        print(f"| {sp} | {max(peaks):.3f} | {max(peaks) / first:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
