"""Rollout engines benchmark: vLLM against the native engine and transformers' ``generate``.

    python -m bench.rollout_engines                 # CPU fp32, needs scripts/setup_vllm.sh's venv
    python -m bench.rollout_engines --sizes 256x4 --grpo-steps 0   # tokens/s only

Three measures:

1. New tokens per second on the same weights: a random ``LlamaForCausalLM`` (the first of
   ``--sizes``, vocab ``--vocab``; ``bench.rollout``'s model) saved with ``save_pretrained``,
   read with ``load_hf``; the ``native`` engine (``NativeEngine``: ``generate``, eager), the
   ``vllm`` engine (a managed server given these weights, fp32, over HTTP as GRPO asks it) and
   transformers' ``generate`` decode the same ``--batch`` random prompts of 8 to 32 tokens,
   greedy, every row exactly ``--new-tokens`` tokens. The three take turns, one call each per
   round, for ``--rounds`` rounds; wall-clock times (the server is another process, so only
   the wall clock compares), the median of each side and the median of the per-round ratios.
2. Weight push against model size: for each of ``--sizes`` (dim x layers), a server on that
   model, then ``VLLMEngine.update_weights`` (safetensors files in /dev/shm, the server's
   ``reload_weights`` between pause and resume), median of ``--pushes``, and the files' write
   alone.
3. A GRPO step's time split: ``grpo_debug`` from random weights (no SFT start, LoRA as the
   recipe has it), ``--grpo-batch`` prompts a step, ``--grpo-steps`` steps with each engine
   (vLLM: a managed server, sync), the median over the steps after the first of the logged
   ``rollout_seconds``, ``weight_push_seconds`` and ``train_seconds``.

Torch runs ``--threads`` CPU threads (default 1, as ``bench.rollout``: on a machine other
processes load, OpenMP threads that wait on each other slow every op); the vLLM server runs
its own, as it is started.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.rollout import _models
from temper.config import load_config
from temper.generation.engines import NativeEngine, SamplingParams
from temper.generation.engines.vllm import VLLMEngine, VLLMSettings, start_vllm
from temper.generation.engines.weights import write_weights
from temper.models.hf import hf_named_tensors
from temper.trainer import Trainer

BUCKET = 512 * 2**20


def _server(model: torch.nn.Module, folder: Path, max_len: int) -> VLLMEngine:
    settings = VLLMSettings(
        url=None,
        python=None,
        weights_dir=Path("/dev/shm") / f"temper-bench-{os.getpid()}",
        bucket_bytes=BUCKET,
        max_model_len=max_len,
        kv_cache_bytes=2**30,
        startup_timeout_s=900,
        log=folder / "vllm.log",
    )
    return start_vllm(settings, model, lambda: hf_named_tensors(model))


def tokens_per_second(args: argparse.Namespace, dim: int, layers: int, folder: Path) -> None:
    native, hf = _models(dim, layers, args.vocab, "cpu", torch.float32)
    rng = torch.Generator().manual_seed(1)
    lengths = torch.randint(8, 33, (args.batch,), generator=rng).tolist()
    prompts = [torch.randint(1, args.vocab, (n,), generator=rng).tolist() for n in lengths]
    width, new = max(lengths), args.new_tokens
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (ids != 0).long()
    for row, n in enumerate(lengths):  # token 0 never appears in a prompt: the mask is exact
        assert int(mask[row].sum()) == n
    params = SamplingParams(max_new_tokens=new)
    server = _server(native, folder, width + new + 8)
    try:

        @torch.no_grad()
        def transformers() -> torch.Tensor:
            out = hf.generate(
                ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False
            )
            return out[:, width:]

        runs: dict[str, Callable[[], torch.Tensor]] = {
            "transformers": transformers,
            "native": lambda: NativeEngine(native).generate(prompts, params).tokens,
            "vllm": lambda: server.generate(prompts, params).tokens,
        }
        server.generate(prompts[:2], params)  # the server's first request warms it
        times: dict[str, list[float]] = {name: [] for name in runs}
        tokens: dict[str, torch.Tensor] = {}
        for _ in range(args.rounds):
            for name, run in runs.items():
                start = time.perf_counter()
                tokens[name] = run()
                times[name].append(time.perf_counter() - start)
    finally:
        server.close()
    print(
        f"\n### tokens/s: batch {args.batch} x {new} new tokens, Llama dim {dim} x {layers}, "
        f"vocab {args.vocab}, CPU fp32, {torch.get_num_threads()} torch threads, "
        f"{args.rounds} rounds\n"
    )
    print(
        "| decoder | wall s (median) | new tokens/s | vs transformers | vs native | same tokens |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in runs:
        median = statistics.median(times[name])
        ratio = {
            ref: statistics.median(r / t for r, t in zip(times[ref], times[name], strict=True))
            for ref in ("transformers", "native")
        }
        same = (tokens[name] == tokens["transformers"]).all(dim=1).float().mean()
        print(
            f"| {name} | {median:.2f} | {args.batch * new / median:.0f} "
            f"| {ratio['transformers']:.2f}x | {ratio['native']:.2f}x | {same:.2f} |"
        )


def weight_pushes(args: argparse.Namespace, folder: Path) -> None:
    rows = []
    for size in args.sizes:
        dim, layers = map(int, size.split("x"))
        model, _ = _models(dim, layers, args.vocab, "cpu", torch.float32)
        params = sum(p.numel() for p in model.parameters())
        server = _server(model, folder, 64)
        scratch = Path("/dev/shm") / f"temper-bench-write-{os.getpid()}"
        try:
            pushes, writes = [], []
            for _ in range(args.pushes):
                start = time.perf_counter()
                server.update_weights(lambda m=model: hf_named_tensors(m))
                pushes.append(time.perf_counter() - start)
                start = time.perf_counter()
                write_weights(scratch, hf_named_tensors(model), BUCKET)
                writes.append(time.perf_counter() - start)
        finally:
            server.close()
            shutil.rmtree(scratch, ignore_errors=True)
        rows.append((size, params, statistics.median(writes), statistics.median(pushes)))
    print(f"\n### weight push, CPU fp32, vocab {args.vocab}, median of {args.pushes}\n")
    print("| model (dim x layers) | parameters | MiB (fp32) | files written s | push s | MiB/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for size, params, write, push in rows:
        mib = params * 4 / 2**20
        print(
            f"| {size} | {params / 1e6:.1f}M | {mib:.0f} | {write:.2f} | {push:.2f} "
            f"| {mib / push:.0f} |"
        )


def grpo_split(args: argparse.Namespace, folder: Path) -> None:
    print(
        f"\n### GRPO step split: grpo_debug from random weights, {args.grpo_batch} prompts x 8 "
        f"samples a step, {args.grpo_steps} steps, median of the steps after the first\n"
    )
    print("| engine | generation s | weight push s | training s | step s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for engine in ("native", "vllm"):
        run = folder / f"grpo-{engine}"
        argv = [
            "--job.dump_folder", str(run), "--metrics.no_tensorboard",
            "--checkpoint.initial_recipe", "", "--training.steps", str(args.grpo_steps),
            "--training.local_batch_size", str(args.grpo_batch), "--rollout.engine", engine,
        ]  # fmt: skip
        assert Trainer(load_config("temper.recipes.posttrain", "grpo_debug", argv)).train()
        lines = (run / "metrics.jsonl").read_text().splitlines()
        steps = [json.loads(line) for line in lines][1:]
        part = {
            name: statistics.median(step[name] for step in steps)
            for name in ("rollout_seconds", "weight_push_seconds", "train_seconds")
        }
        total = sum(part.values())
        print(
            f"| {engine} | {part['rollout_seconds']:.2f} | {part['weight_push_seconds']:.2f} "
            f"| {part['train_seconds']:.2f} | {total:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", nargs="+", default=["256x4", "512x8", "1024x8"])
    parser.add_argument("--pushes", type=int, default=3)
    parser.add_argument("--grpo-steps", type=int, default=3)
    parser.add_argument("--grpo-batch", type=int, default=4, help="prompts a GRPO step")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        dim, layers = map(int, args.sizes[0].split("x"))
        tokens_per_second(args, dim, layers, folder)
        weight_pushes(args, folder)
        if args.grpo_steps > 1:
            grpo_split(args, folder)


if __name__ == "__main__":
    main()
