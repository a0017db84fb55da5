"""Optimizer step time, memory and communication: Muon against AdamW, one process and FSDP.

    python -m bench.optimizer_step                                    # llama3 debug, 1 and 2 ranks
    python -m bench.optimizer_step --model llama3:1b --layers 1 --steps 2
    python -m bench.optimizer_step --model qwen3_moe:debug --world 1,2 --ep 2
    python -m bench.optimizer_step --device cuda --world 1 --model llama3:8b --layers 4

Each (optimizer, world) case runs in fresh gloo processes (one CPU thread each): the model
is built as the trainer builds it (FSDP2 over every rank when world > 1), every gradient is
set to fixed random values, and ``optimizer.step()`` runs ``--steps`` times; the first warms
up (it allocates the state) and the time is the slowest rank's fastest later step, beside
its CPU time (on a machine whose cores other work shares, the CPU seconds a rank spent show
how work divides over ranks better than the wall clock). Memory
per rank: the optimizer state's bytes, and the resident set's high-water mark during the
timed steps above the resident set before them (on CUDA the allocator's peak above its
allocation before them; Muon's owner rank holds whole matrices and
the Newton-Schulz temporaries there). Communication: the bytes Muon's all-to-alls sent and
received on the busiest rank, against what gathering every sharded matrix on every rank
(in the same dtype) would have received, and how many row-sharded matrices each rank
orthogonalized (whole experts under ``--ep`` stay on their rank). ``--layers N`` keeps N
blocks of the flavor: every block has the same shapes, so a block costs the blocks' share
of the full model over n_layers.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.train_step import _peak_rss_gib, _reset_peak, _rss_gib

MIB = 2**20


def _rank(
    model_name: str, layers: int, optimizer: str, ns_dtype: str, steps: int, ep: int, device: str
) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from temper.config import Config
    from temper.models import get_model_spec, materialize
    from temper.optim import build_optimizer
    from temper.optim.muon import Muon
    from temper.parallel.dims import ParallelDims
    from temper.parallel.parallelize import parallelize_decoder

    family, flavor = model_name.split(":")
    spec = get_model_spec(family)
    args = spec.flavors[flavor]
    if layers:
        args = dataclasses.replace(args, n_layers=layers)
    config = Config()
    config.model.name, config.model.flavor = family, flavor
    config.optimizer.name = optimizer
    config.optimizer.muon_ns_dtype = ns_dtype
    config.parallelism.ep = ep
    world = int(os.environ["WORLD_SIZE"])
    meshes = None
    if world > 1:
        dist.init_process_group("gloo")
        meshes = ParallelDims.from_config(config.parallelism, world).build_meshes("cpu")
    with torch.device("meta"):
        model = spec.model_cls(args)
    parallelize_decoder(model, config, meshes, torch.float32)
    where = torch.device(device)
    model = materialize(model, where)
    generator = torch.Generator(where).manual_seed(0)
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        grad = torch.randn(local.shape, generator=generator, device=where) * 1e-3
        if isinstance(p, DTensor):
            grad = DTensor.from_local(
                grad, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )
        p.grad = grad
    opt = build_optimizer(model, config.optimizer)
    opt.step()  # allocates the state
    cuda = where.type == "cuda"
    before = torch.cuda.memory_allocated(where) / 2**30 if cuda else _rss_gib()
    _reset_peak(where)
    times, cpu = [], []
    for _ in range(steps - 1):
        if world > 1:
            dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        opt.step()
        if cuda:
            torch.cuda.synchronize(where)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    peak = (torch.cuda.max_memory_allocated(where) / 2**30 if cuda else _peak_rss_gib()) - before
    state = sum(
        (v.to_local() if isinstance(v, DTensor) else v).nbytes
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    comm = opt.comm if isinstance(opt, Muon) else None
    return {
        "time": min(times),
        "cpu": min(cpu),
        "matrices": comm.matrices if comm else 0,
        "state_mib": state / MIB,
        "peak_mib": 1024 * peak,
        "sent_mib": comm.sent / MIB if comm else 0.0,
        "received_mib": comm.received / MIB if comm else 0.0,
        "all_gather_mib": comm.all_gather_received / MIB if comm else 0.0,
        "params": sum(p.numel() for p in model.parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3:debug", help="family:flavor")
    parser.add_argument("--layers", type=int, default=0, help="keep this many blocks; 0 = all")
    parser.add_argument("--world", default="1,2", help="comma-separated FSDP sizes")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps, the first warms up")
    parser.add_argument(
        "--ns-dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="Newton-Schulz dtype; auto resolves as the trainer's optimizer.muon_ns_dtype auto",
    )
    parser.add_argument("--ep", type=int, default=1, help="expert parallelism when ranks > 1")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (one rank only)")
    args = parser.parse_args()
    if args.device != "cpu" and args.world != "1":
        parser.error("--device cuda runs one rank: pass --world 1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))
    from harness import run_on_ranks

    from temper.optim.optimizer import newton_schulz_dtype

    layers = f", {args.layers} blocks" if args.layers else ""
    ns = f"Newton-Schulz {newton_schulz_dtype(args.ns_dtype, torch.device(args.device))}"
    print(f"{args.model}{layers}, fp32 {args.device}, {ns}, torch {torch.__version__}\n")
    print(
        "| ranks | optimizer | step (s) | vs AdamW | CPU s/rank | state MiB/rank "
        "| step peak MiB/rank | sharded matrices/rank | sent MiB | received MiB "
        "| all-gather would receive MiB |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for world in map(int, args.world.split(",")):
        adamw_time = None
        for optimizer in ("adamw", "muon"):
            ep = args.ep if world > 1 else 1
            ranks: list[Any] = run_on_ranks(
                _rank,
                world,
                args.model,
                args.layers,
                optimizer,
                args.ns_dtype,
                args.steps,
                ep,
                args.device,
                timeout=3600.0,
            )
            step = max(r["time"] for r in ranks)
            adamw_time = adamw_time or step
            busiest = max(ranks, key=lambda r: r["received_mib"])
            cells = [
                str(world),
                optimizer,
                f"{step:.3f}",
                f"{step / adamw_time:.2f}x",
                f"{max(r['cpu'] for r in ranks):.3f}",
                f"{max(r['state_mib'] for r in ranks):.1f}",
                f"{max(r['peak_mib'] for r in ranks):.1f}",
            ]
            if optimizer == "muon" and world > 1:
                cells.append("/".join(str(r["matrices"]) for r in ranks))
                keys = ("sent_mib", "received_mib", "all_gather_mib")
                cells += [f"{busiest[k]:.1f}" for k in keys]
            else:
                cells += ["-"] * 4
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
