"""Per-rank tensor memory and step time of context parallelism against context length.

    python -m bench.context_parallel                               # CP 1, 2, 4 at 4K and 8K
    python -m bench.context_parallel --runs 1:16384,4:65536        # the long-context pair
    python -m bench.context_parallel --runs 2:8192 --reference     # the reference kernel
    python -m bench.context_parallel --attention --runs 4:16384    # ring attention alone
    python -m bench.context_parallel --attention --documents 1000  # on packed rows

A run is ``cp:tokens``: that many gloo ranks (fresh processes, one thread each), all one CP
group, train ``--recipe`` on one continuous row of ``tokens`` for ``--steps`` steps (the
first warms up unless it is the only one) and measure the last step: its live-tensor peak
(a dispatch mode counts every storage an op creates until it is freed, as
``bench.plan_memory`` does) on top of the tensors alive when it starts (weights, buffers,
optimizer state: what CP shares out only through FSDP), and its wall time, which includes
the counting's overhead. The table shows the busiest rank. CP 1 is the plain model (SDPA);
CP > 1 runs ring attention with the fused per-block kernel unless ``--reference``.

The dispatch mode sees the ops of the rank's own thread; gloo's buffers are not tensors and
are not counted.

``--attention``: ring attention alone (the debug model's heads: 8 query, 4 key/value heads of
32), forward and backward on random fp32 inputs, the second of two calls timed, with the
fused per-block kernel and with the reference, each with transfers overlapping the block
compute and waited for first: whether the overlap shows on gloo. ``--documents N``: the row
packed with documents of N tokens (the last shorter), so blocks hold document boundaries.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.plan_memory import step_tensor_peak

GIB = 2**30


def measure_rank(
    recipe: str, seq_len: int, cp: int, steps: int, folder: str, extra: list[str]
) -> tuple[float, float, float]:
    """On one rank: (the last step's live-tensor peak above what was alive at its start,
    what was alive then, its wall time in seconds); bytes as GiB."""
    from temper.config import load_config
    from temper.trainer.trainer import Trainer

    argv = ["--job.dump_folder", folder, "--metrics.no_tensorboard", "--training.steps"]
    argv += [str(steps), "--training.seq_len", str(seq_len), "--training.local_batch_size", "1"]
    argv += ["--parallelism.cp", str(cp), "--training.global_batch_size", "-1"]
    argv += ["--profiling.no_phase_times", *extra]
    module = "temper.recipes.llama3" if recipe.startswith("llama3") else "temper.recipes.qwen3"
    trainer = Trainer(load_config(module, recipe, argv))
    batches = iter(trainer.loader)
    for _ in range(steps - 1):
        trainer.train_step([next(batches)])
    start = time.perf_counter()
    alive, peak = step_tensor_peak(trainer, next(batches))
    return peak / GIB, alive / GIB, time.perf_counter() - start


def time_attention(seq_len: int, fused: bool, overlap: bool, document: int | None) -> float:
    """On one rank: seconds of ring attention's forward and backward over ``seq_len`` tokens
    split over every rank (one row: continuous, or documents of ``document`` tokens), the
    second of two calls."""
    import torch.distributed as dist

    from temper.kernels.attention import DocumentMask
    from temper.kernels.ring_attention import ring_attention

    dist.init_process_group("gloo")
    local = seq_len // dist.get_world_size()
    g = torch.Generator().manual_seed(dist.get_rank())
    q, k, v = (torch.randn(1, local, h, 32, generator=g) for h in (8, 4, 4))
    docs = None
    if document is not None:
        docs = DocumentMask.from_starts(torch.arange(seq_len)[None] % document == 0)
    seconds = 0.0
    for _ in range(2):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        dist.barrier()
        start = time.perf_counter()
        out = ring_attention(*inputs, docs, dist.group.WORLD, fused=fused, overlap=overlap)
        out.sum().backward()
        seconds = time.perf_counter() - start
    return seconds


def attention_table(
    runs: str, document: int | None, run_on_ranks: Callable[..., list[Any]]
) -> None:
    print("\n| tokens | CP | kernel | overlapped (s) | in series (s) |")
    print("| ---: | ---: | --- | ---: | ---: |", flush=True)
    for run in runs.split(","):
        cp, seq_len = map(int, run.split(":"))
        for fused in (True, False):
            times = [
                max(
                    run_on_ranks(
                        time_attention, cp, seq_len, fused, overlap, document, timeout=3600.0
                    )
                )
                for overlap in (True, False)
            ]
            kernel = "fused" if fused else "reference"
            print(f"| {seq_len} | {cp} | {kernel} | {times[0]:.2f} | {times[1]:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="llama3_debug")
    parser.add_argument(
        "--runs", default="1:4096,2:4096,4:4096,1:8192,2:8192,4:8192", help="cp:tokens, ..."
    )
    parser.add_argument("--steps", type=int, default=2, help="steps per run; the last measured")
    parser.add_argument("--reference", action="store_true", help="ring attention's reference")
    parser.add_argument("--attention", action="store_true", help="time ring attention alone")
    parser.add_argument(
        "--documents", type=int, default=None, help="--attention: documents of N tokens"
    )
    args = parser.parse_args()
    if args.documents is not None and not args.attention:
        parser.error("--documents times ring attention alone: add --attention")
    extra = ["--kernels.no_fused_ring_attention"] if args.reference else []
    # The tests' gloo launcher: N fresh processes, a failing or hung rank reported.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))
    from harness import run_on_ranks

    if args.attention:
        attention_table(args.runs, args.documents, run_on_ranks)
        return
    print(f"{args.recipe}, fp32 CPU, torch {torch.__version__}, {' '.join(extra) or 'defaults'}")
    print(
        "\n| tokens | CP | tokens per rank | step's tensor peak per rank (GiB) | alive before "
        "it (GiB) | step time (s) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
    for run in args.runs.split(","):
        cp, seq_len = map(int, run.split(":"))
        with tempfile.TemporaryDirectory() as folder:
            ranks = run_on_ranks(
                measure_rank,
                cp,
                args.recipe,
                seq_len,
                cp,
                args.steps,
                folder,
                extra,
                timeout=7200.0,
            )
        peak, alive, seconds = max(ranks)
        slowest = max(t for _, _, t in ranks)
        print(
            f"| {seq_len} | {cp} | {seq_len // cp} | {peak:.3f} | {alive:.3f} | {slowest:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
