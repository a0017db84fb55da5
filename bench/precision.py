"""Memory and speed of the precision schemes (docs/precision.md) on one device.

    python -m bench.precision                                          # llama3 debug, CPU, fp32
    python -m bench.precision --device cuda --model llama3:8b --layers 4 --seq-len 4096 \
        --schemes base,float8_tensorwise,float8_rowwise
    python -m bench.precision --device cuda --model llama3:8b --layers 4 --schemes lora,qlora
    python -m bench.precision --world 2 --schemes base,lora,qlora      # FSDP2 over 2 CPU ranks

Each scheme runs in a fresh process: the model is built on meta (``--layers N`` keeps N of
the flavor's blocks), given the scheme (FP8 layers; LoRA rank 16 on every linear layer, its
base in NF4 for qlora; torchao's 8-bit AdamW), materialized and trained for ``--steps``
steps on one random batch with the causal-LM objective (bf16 autocast on CUDA, fp32 on CPU).
Reported: the weights' bytes (an NF4 base counted by its codes and scales), the gradients'
and optimizer state's bytes after a step, the peak memory of the whole step (CUDA: the
allocator's peak; CPU: the resident set's high-water mark above the one before the model
existed), and tokens/s of the fastest step after the first. With ``--world N`` each scheme
runs on N gloo ranks, every block and the root wrapped by FSDP2 (``fully_shard``) on meta
before materializing, and the figures are rank 0's: its shards' bytes and its own peak.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import multiprocessing as mp
import time
import traceback
from pathlib import Path

import torch

SCHEMES = (
    "base",
    "float8_tensorwise",
    "float8_rowwise",
    "adamw8bit",
    "lora",
    "qlora",
)


def measure(scheme: str, model_name: str, layers: int, batch: int, seq_len: int, steps: int,
            device: str, world: int = 1) -> dict:  # fmt: skip
    from temper.config import Float8, Optimizer
    from temper.models import get_model_spec, materialize
    from temper.models.lora import apply_lora, init_lora
    from temper.objectives import CausalLM
    from temper.optim import build_optimizer, state_bytes
    from temper.optim.low_bit import tensor_bytes
    from temper.quantize import apply_float8, quantize_lora_base

    dev = torch.device(device)
    rss_before = _rss_gib()
    family, flavor = model_name.split(":")
    spec = get_model_spec(family)
    args = spec.flavors[flavor]
    if layers:
        args = dataclasses.replace(args, n_layers=layers)
    with torch.device("meta"):
        model = spec.model_cls(args)
    if scheme.startswith("float8"):
        recipe = scheme.removeprefix("float8_")
        apply_float8(model, Float8(enable=True, recipe=recipe, emulate=dev.type != "cuda"))
    if scheme in ("lora", "qlora"):
        apply_lora(model, ["all-linear"], rank=16, alpha=32.0)
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
    torch.manual_seed(0)
    model = materialize(model, dev)
    init_lora(model)
    if scheme == "qlora":
        quantize_lora_base(model)
    name = "adamw8bit" if scheme == "adamw8bit" else "adamw"
    optimizer = build_optimizer(model, Optimizer(name=name, lr=1e-4))
    objective = CausalLM()
    ids = torch.randint(0, args.vocab_size, (batch, seq_len + 1), generator=torch.Generator())
    ids = ids.to(dev)
    bf16 = dev.type == "cuda"
    autocast = torch.autocast("cuda", torch.bfloat16) if bf16 else contextlib.nullcontext()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        with autocast:
            loss_sum, n_tokens, _ = objective.loss(
                model, {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
            )
        (loss_sum / n_tokens).backward()
        grads = sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - start)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev) / 2**20
    else:
        peak = (_peak_rss_gib() - rss_before) * 1024
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "weights_mib": sum(tensor_bytes(p) for p in model.parameters()) / 2**20,
        "grads_mib": grads / 2**20,
        "state_mib": state_bytes(optimizer) / 2**20,
        "peak_mib": peak,
        "tokens_per_second": batch * seq_len / min(times[1:]),
        "loss": loss_sum.item() / n_tokens.item(),
    }


def _status_gib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def _rss_gib() -> float:
    return _status_gib("VmRSS")


def _peak_rss_gib() -> float:
    return _status_gib("VmHWM")


def _main(queue: mp.Queue, *args: object) -> None:
    try:
        queue.put(measure(*args))
    except Exception:
        queue.put({"error": traceback.format_exc()})


def _rank_main(rank: int, port: int, queue: mp.Queue, *args: object) -> None:
    """One of ``world`` gloo ranks measuring a scheme; rank 0 reports."""
    import os

    import torch.distributed as dist

    world = args[-1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        result = measure(*args)
    except Exception:
        result = {"error": traceback.format_exc()}
    dist.destroy_process_group()
    if rank == 0:
        queue.put(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="llama3:debug")
    parser.add_argument("--layers", type=int, default=0, help="keep this many blocks; 0 = all")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--world", type=int, default=1, help="FSDP2 ranks (gloo, CPU)")
    args = parser.parse_args()
    dtype = "bf16 autocast" if args.device == "cuda" else "fp32"
    hardware = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    layers = f", {args.layers} blocks" if args.layers else ""
    layers += f", FSDP2 over {args.world} ranks (rank 0's figures)" if args.world > 1 else ""
    print(
        f"{args.model}{layers}, {hardware}, {dtype}, batch {args.batch} x {args.seq_len}, "
        f"fastest of {args.steps} steps after one, torch {torch.__version__}\n"
    )
    print(
        "| scheme | weights MiB | grads MiB | optimizer state MiB | step peak MiB | tok/s | loss |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    ctx = mp.get_context("spawn")
    for scheme in args.schemes.split(","):
        queue = ctx.Queue()
        measured = (scheme, args.model, args.layers, args.batch, args.seq_len, args.steps,
                    args.device, args.world)  # fmt: skip
        port = 29400 + SCHEMES.index(scheme)
        procs = [
            ctx.Process(target=_rank_main, args=(rank, port, queue, *measured))
            if args.world > 1
            else ctx.Process(target=_main, args=(queue, *measured))
            for rank in range(args.world)
        ]
        for proc in procs:
            proc.start()
        result = queue.get()
        for proc in procs:
            proc.join()
        if "error" in result:
            print(f"| {scheme} | failed: {result['error'].strip().splitlines()[-1]} |")
            continue
        print(
            f"| {scheme} | {result['weights_mib']:.1f} | {result['grads_mib']:.1f} "
            f"| {result['state_mib']:.1f} | {result['peak_mib']:.0f} "
            f"| {result['tokens_per_second']:,.0f} | {result['loss']:.4f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
