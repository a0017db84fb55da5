"""The dry run's peak-memory estimate against the peak a real run measures, on CPU (gloo).

    python -m bench.plan_memory                      # dense and MoE debug recipes, world 1, 2, 4
    python -m bench.plan_memory --cases llama3_debug:1,qwen3_moe_debug:2 --seq-len 256

For each case, that many gloo ranks (fresh processes, one thread each) train the recipe for
three steps (the first creates the optimizer state) and measure two peaks:

- the resident set's high-water mark during the second step minus the resident set before
  the Engine was built: what the run adds to the process, tensors and everything else
  (gloo's buffers, autograd's graph, Python objects). glibc is told to map every
  allocation over 64 KiB on its own (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the
  resident set instead of lingering in the heap;
- the live-tensor peak of the third step: a dispatch mode counts every storage an op
  creates until it is freed, on top of the tensors alive when the step starts (weights,
  buffers, optimizer state): tensor memory alone, which is what the plan estimates.

``temper.plan`` plans the same config for the same world on ``cpu`` in this process. The
table shows rank 0 and the ratios.

``--device cuda`` (world 1 cases, in this process, bf16): the allocator's peak during the
second step minus what it held before the Engine was built, against the plan on ``cuda``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import weakref
from pathlib import Path

import torch

from bench.train_step import _peak_rss_gib, _reset_peak, _rss_gib
from temper.utils.compat import TorchDispatchMode

MODULES = {"llama3": "temper.recipes.llama3", "qwen3": "temper.recipes.qwen3"}


def _argv(folder: str, seq_len: int, batch: int, extra: list[str]) -> list[str]:
    return [
        "--job.dump_folder",
        folder,
        "--metrics.no_tensorboard",
        "--training.steps",
        "3",
        "--training.seq_len",
        str(seq_len),
        "--training.local_batch_size",
        str(batch),
        "--profiling.no_phase_times",
        *extra,
    ]


def _module(recipe: str) -> str:
    return MODULES[recipe.split("_")[0]]


class LiveTensors(TorchDispatchMode):
    """The peak bytes of the storages that ops create while it is on, each counted until
    it is freed: tensor memory as the run really allocates it, without the process's own."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _track(self, t: object) -> None:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return
        storage = t.untyped_storage()
        key, size = storage._cdata, storage.nbytes()
        if key in self._seen:
            return
        self._seen.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            self._track(t)
        return out


def _measure(recipe: str, folder: str, argv: list[str]) -> tuple[float, float]:
    """(resident-set peak of step 2, live-tensor peak of step 2 plus the tensors alive at its
    start: weights, buffers and optimizer state), GiB."""
    from temper.config import load_config
    from temper.trainer.trainer import Trainer

    before = _rss_gib()
    trainer = Trainer(load_config(_module(recipe), recipe, argv))
    batches = iter(trainer.loader)
    trainer.train_step([next(batches)])
    _reset_peak(trainer.engine.device)
    trainer.train_step([next(batches)])
    rss = _peak_rss_gib() - before
    model, optimizer = trainer.engine.model, trainer.engine.optimizer
    held = [*model.parameters(), *model.buffers()]
    held += [v for state in optimizer.state.values() for v in state.values()]
    alive = sum(_local(t).untyped_storage().nbytes() for t in held if isinstance(t, torch.Tensor))
    tracker = LiveTensors()
    with tracker:
        trainer.train_step([next(batches)])
    return rss, (alive + tracker.peak) / 2**30


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _measure_cuda(recipe: str, argv: list[str]) -> float:
    from temper.config import load_config
    from temper.trainer.trainer import Trainer

    device = torch.device("cuda")
    before = torch.cuda.memory_allocated(device)
    trainer = Trainer(load_config(_module(recipe), recipe, argv))
    batches = iter(trainer.loader)
    trainer.train_step([next(batches)])
    torch.cuda.reset_peak_memory_stats(device)
    trainer.train_step([next(batches)])
    peak = (torch.cuda.max_memory_allocated(device) - before) / 2**30
    del trainer
    torch.cuda.empty_cache()
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases",
        default="llama3_debug:1,llama3_debug:2,llama3_debug:4,"
        "qwen3_moe_debug:1,qwen3_moe_debug:2,qwen3_moe_debug:4",
    )
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--extra", default="", help="more overrides for every case, one string")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))
    from harness import run_on_ranks

    import temper.engine  # noqa: F401
    from temper.config import load_config
    from temper.plan import plan_run

    extra = args.extra.split()
    where = "fp32 CPU" if args.device == "cpu" else f"bf16 {torch.cuda.get_device_name()}"
    print(f"{args.batch} x {args.seq_len} tokens per rank, {where}, torch {torch.__version__}\n")
    print(
        "| recipe | world | estimated peak (GiB) | resident-set peak (GiB) | estimate / it "
        "| live-tensor peak (GiB) | estimate / it |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
    for case in args.cases.split(","):
        recipe, world = case.split(":")
        with tempfile.TemporaryDirectory() as folder:
            argv = _argv(folder, args.seq_len, args.batch, extra)
            config = load_config(_module(recipe), recipe, argv, validate=False)
            plan = plan_run(config, int(world), args.device)
            if plan.errors:
                raise SystemExit(f"{case}: {plan.errors}")
            estimate = plan.ranks[0].peak / 2**30
            if args.device == "cuda":
                measured = tensors = _measure_cuda(recipe, argv)
            else:
                ranks = run_on_ranks(_measure, int(world), recipe, folder, argv, timeout=3600.0)
                measured, tensors = ranks[0]
        print(
            f"| {recipe} | {world} | {estimate:.3f} | {measured:.3f} | {estimate / measured:.2f} "
            f"| {tensors:.3f} | {estimate / tensors:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
