"""Rollout benchmark: new tokens per second of ``temper.generation.generate`` (eager, and
compiled on a static KV cache) against transformers' ``generate``, same weights, greedy.

    python -m bench.rollout                        # batch 64 x 128 new tokens, CPU fp32
    python -m bench.rollout --device cuda --dtype bfloat16 --batch 256

A random ``LlamaForCausalLM`` (``--dim``, ``--layers``, GQA 8 heads on 2) is saved with
``save_pretrained`` and Temper reads it with ``load_hf``. The prompts are ``--batch`` random
token rows of 8 to 32 tokens, left-padded for transformers (with its attention mask). Every
row decodes exactly ``--new-tokens`` tokens (no stop token). The compiled step is built by a
warm-up call first, timed apart (``compile_s``); then the three take turns, one call each
per round, so load from other processes falls on all alike, and each time is the median
over ``--rounds``. ``--threads`` (1) sets torch's CPU threads: on a machine other
processes load, OpenMP threads that wait on each other at every op ran one 32-token call
30x slower than one thread did. ``same_tokens`` is the share of rows whose greedy tokens equal
transformers' (random weights have near-ties that float rounding may flip late in a row).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from temper.generation import generate
from temper.models import load_hf


def _models(dim: int, layers: int, vocab: int, device: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=int(dim * 8 / 3) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        native = load_hf(folder).eval()
    return native.to(device, dtype), hf.to(device, dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    native, hf = _models(args.dim, args.layers, args.vocab, args.device, dtype)
    rng = torch.Generator().manual_seed(1)
    lengths = torch.randint(8, 33, (args.batch,), generator=rng).tolist()
    prompts = [torch.randint(1, args.vocab, (n,), generator=rng).tolist() for n in lengths]
    width = max(lengths)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=args.device)
    starts = width - torch.tensor(lengths, device=args.device)
    mask = (torch.arange(width, device=args.device) >= starts[:, None]).long()
    new = args.new_tokens

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def ours(compile: bool) -> torch.Tensor:
        return generate(native, prompts, new, compile=compile).tokens

    @torch.no_grad()
    def theirs() -> torch.Tensor:
        out = hf.generate(
            ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
        return out[:, width:]

    runs: dict[str, Callable[[], torch.Tensor]] = {
        "transformers": theirs,
        "temper eager": lambda: ours(False),
        "temper compiled": lambda: ours(True),
    }
    start = time.perf_counter()
    ours(True)
    sync()
    compile_s = time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in runs}
    tokens: dict[str, torch.Tensor] = {}
    for _ in range(args.rounds):
        for name, run in runs.items():
            sync()
            start = time.perf_counter()
            tokens[name] = run()
            sync()
            times[name].append(time.perf_counter() - start)
    reference = tokens["transformers"]
    base = statistics.median(times["transformers"])
    print(
        f"batch {args.batch} x {new} new tokens, Llama dim {args.dim} x {args.layers} layers, "
        f"vocab {args.vocab}, {args.device} {args.dtype}, {args.threads} threads; "
        f"compile_s {compile_s:.1f}"
    )
    print("| decoder | seconds | new tokens/s | vs transformers | same_tokens |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in runs:
        seconds = statistics.median(times[name])
        same = (tokens[name] == reference).all(dim=1).float().mean().item()
        rate = args.batch * new / seconds
        print(f"| {name} | {seconds:.2f} | {rate:.0f} | {base / seconds:.2f}x | {same:.2f} |")


if __name__ == "__main__":
    main()
