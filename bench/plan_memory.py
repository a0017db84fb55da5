"""The dry run's peak-memory estimate against the peak a real run measures, on CPU (gloo).

    python -m bench.plan_memory    # each debug family x {fsdp, ep, sp} x checkpointing, world 2
    python -m bench.plan_memory --cases llama3_debug:1,qwen3_moe_debug:2:ep --modes none,full

A case is ``recipe:world[:layout]``; the layout is ``fsdp`` (the default), ``ep`` (expert
parallelism over every rank) or ``sp`` (Ulysses over every rank); each case runs once per
activation checkpointing mode of ``--modes``. For each, that many gloo ranks (fresh
processes, one thread each) train the recipe for three steps (the first creates the
optimizer state) and measure two peaks:

- the resident set's high-water mark during the second step minus the resident set before
  the Engine was built: what the run adds to the process, tensors and everything else
  (gloo's buffers, autograd's graph, Python objects). glibc is told to map every
  allocation over 64 KiB on its own (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the
  resident set instead of lingering in the heap;
- the live-tensor peak of the third step: a dispatch mode counts every storage an op
  creates until it is freed, on top of the tensors alive when the step starts (weights,
  buffers, optimizer state): tensor memory alone, which is what the plan estimates.

``temper.plan`` plans the same config for the same world on ``cpu`` in this process. The
table shows the busiest rank (the largest live-tensor peak) against the plan's largest, and,
for MoE models, the routing imbalance of the third step: the rows the busiest of ``world``
expert-parallel ranks would receive over the mean, whatever the case's own layout.

``--device cuda`` (world 1 cases, in this process, bf16): the allocator's peak during the
second step minus what it held before the Engine was built, against the plan on ``cuda``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.train_step import _peak_rss_gib, _reset_peak, _rss_gib
from temper.plan.activations import LiveBytes
from temper.utils.compat import TorchDispatchMode

MODULES = ("llama3", "qwen3", "qwen3_5", "deepseek_v3", "gpt_oss")
"""The recipe modules (under ``temper.recipes``) a case's recipe is looked up in."""

CASES = ",".join(
    f"{recipe}:2:{layout}"
    for recipe in ("deepseek_v3_debug", "qwen3_moe_debug", "qwen3_5_moe_debug", "llama3_debug")
    for layout in ("fsdp", "ep", "sp")
    if layout != "ep" or recipe != "llama3_debug"
)
"""Each debug family (Qwen3.5-MoE for the Gated DeltaNet hybrids) under each layout."""

LAYOUTS = {"fsdp": [], "ep": ["--parallelism.ep"], "sp": ["--parallelism.sp"]}


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
    import importlib

    for name in MODULES:
        module = f"temper.recipes.{name}"
        if hasattr(importlib.import_module(module), recipe):
            return module
    raise SystemExit(f"no recipe {recipe} in temper.recipes.{{{', '.join(MODULES)}}}")


class LiveTensors(TorchDispatchMode):
    """The peak bytes of the storages that ops create while it is on, each counted until
    it is freed: tensor memory as the run really allocates it, without the process's own.
    A DTensor op's output counts as its local shard: the wrapper holds no memory, and the
    shard is made by ops below this mode, which it does not see (counted as the wrapper, the
    optimizer step's sharded gradients and temporaries read at their global size). Storages
    of ``held`` (counted apart) are never counted, though in-place ops (the optimizer's on
    the weights and its state) return them."""

    def __init__(self, held: list[torch.Tensor]) -> None:
        super().__init__()
        self.bytes = LiveBytes({_local(t).untyped_storage()._cdata for t in held})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            self.bytes.track(_local(t))
        return out


def _measure(recipe: str, folder: str, argv: list[str]) -> tuple[float, float, torch.Tensor]:
    """(resident-set peak of step 2, live-tensor peak of step 3 plus the tensors alive at its
    start: weights, buffers and optimizer state, GiB; step 3's tokens per expert of this
    rank's tokens [MoE layers, experts])."""
    from temper.config import load_config
    from temper.trainer.trainer import Trainer

    before = _rss_gib()
    trainer = Trainer(load_config(_module(recipe), recipe, argv))
    batches = iter(trainer.loader)
    trainer.train_step([next(batches)])
    _reset_peak(trainer.engine.device)
    trainer.train_step([next(batches)])
    rss = _peak_rss_gib() - before
    alive, peak = step_tensor_peak(trainer, next(batches))
    return rss, (alive + peak) / 2**30, _routed(trainer.engine.model)


def step_tensor_peak(trainer: Any, batch: Any) -> tuple[int, int]:
    """Bytes of the tensors alive before one training step on ``batch`` (weights, buffers,
    optimizer state) and the live-tensor peak of that step above them."""
    model, optimizer = trainer.engine.model, trainer.engine.optimizer
    held = [*model.parameters(), *model.buffers()]
    held += [v for state in optimizer.state.values() for v in state.values()]
    held = [t for t in held if isinstance(t, torch.Tensor)]
    alive = sum(_local(t).untyped_storage().nbytes() for t in held)
    tracker = LiveTensors(held)
    with tracker:
        trainer.train_step([batch])
    return alive, tracker.bytes.peak


def _routed(model: torch.nn.Module) -> torch.Tensor:
    from temper.models.protocols import RoutedModel

    if not isinstance(model, RoutedModel):
        return torch.zeros(0, 0)
    return torch.stack([s.tokens_per_expert for s in model.routing()])


def ep_imbalance(counts: torch.Tensor, ep: int) -> float:
    """Rows the busiest of ``ep`` ranks receives over all MoE layers, over the mean: the
    experts split in ``ep`` contiguous blocks (EP's Shard(0)), ``counts`` [layers, experts]
    the global batch's."""
    per_rank = counts.view(counts.shape[0], ep, -1).sum(dim=(0, 2)).double()
    return float(per_rank.max() / per_rank.mean())


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


def _case_argv(layout: str, world: int, mode: str) -> list[str]:
    flags = [*LAYOUTS[layout], str(world)] if LAYOUTS[layout] else []
    return [*flags, "--activation_checkpoint.mode", mode]


def _run_case(recipe: str, world: int, folder: str, argv: list[str], device: str) -> str:
    """One table row after the first three cells: planned, measured and their ratios."""
    from harness import run_on_ranks

    from temper.config import load_config
    from temper.plan import plan_run

    config = load_config(_module(recipe), recipe, argv, validate=False)
    plan = plan_run(config, world, device)
    if plan.errors:
        raise SystemExit(f"{recipe}: {plan.errors}")
    estimate = max(r.peak for r in plan.ranks) / 2**30
    if device == "cuda":
        rss = tensors = _measure_cuda(recipe, argv)
        imbalance = "-"
    else:
        ranks = run_on_ranks(_measure, world, recipe, folder, argv, timeout=3600.0)
        rss, tensors, _ = max(ranks, key=lambda r: r[1])
        counts = sum(r[2] for r in ranks)
        imbalance = f"{ep_imbalance(counts, world):.2f}" if counts.numel() else "-"
    return (
        f"{estimate:.3f} | {rss:.3f} | {estimate / rss:.2f} | {tensors:.3f} | "
        f"{estimate / tensors:.2f} | {imbalance}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=CASES, help="recipe:world[:fsdp|ep|sp], comma-separated")
    parser.add_argument("--modes", default="none,full,selective", help="checkpointing modes")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--extra", default="", help="more overrides for every case, one string")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))
    import temper.engine  # noqa: F401

    where = "fp32 CPU" if args.device == "cpu" else f"bf16 {torch.cuda.get_device_name()}"
    print(f"{args.batch} x {args.seq_len} tokens per rank, {where}, torch {torch.__version__}\n")
    print(
        "| recipe | layout | checkpointing | planned peak (GiB) | resident-set peak (GiB) "
        "| planned / it | live-tensor peak (GiB) | planned / it | routing imbalance |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
    for case in args.cases.split(","):
        recipe, world, layout = (case + ":fsdp").split(":")[:3]
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory() as folder:
                argv = _argv(folder, args.seq_len, args.batch, args.extra.split())
                argv += _case_argv(layout, int(world), mode)
                row = _run_case(recipe, int(world), folder, argv, args.device)
            name = layout if int(world) > 1 else "one rank"
            print(f"| {recipe} | {name} {world} | {mode} | {row} |", flush=True)


if __name__ == "__main__":
    main()
