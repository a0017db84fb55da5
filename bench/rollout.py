"""Rollout benchmark: new tokens per second of ``temper.generation.generate`` (eager, and
compiled on a static KV cache) against transformers' ``generate``, same weights, greedy.

    python -m bench.rollout                        # batch 64 x 128 new tokens, CPU fp32
    python -m bench.rollout --device cuda --dtype bfloat16 --batch 256

A random ``LlamaForCausalLM`` (``--dim``, ``--layers``, GQA 8 heads on 2) is saved with
``save_pretrained`` and Temper reads it with ``load_hf``. The prompts are ``--batch`` random
token rows of 8 to 32 tokens, left-padded for transformers (with its attention mask). Every
row decodes exactly ``--new-tokens`` tokens (no stop token). The compiled step is built by a
warm-up call first, timed apart (``compile_s``); then the four take turns, one call each
per round, so load from other processes falls on all alike, and each time is the median
over ``--rounds``. ``--threads`` (1) sets torch's CPU threads: on a machine other
processes load, OpenMP threads that wait on each other at every op ran one 32-token call
30x slower than one thread did. Each call is timed twice: wall-clock and this process's CPU
time (``time.process_time``); with one thread on a shared machine the CPU time is what the
decoder itself cost, the wall time adds the waits for a core, which the load decides. The
rates and ratios are given for both. ``matmuls alone`` times only the decode steps' matrix
products on the same weights (each linear layer once per new token on a [batch, in] input):
transformers' time over it bounds what a decoder that runs the same products through
torch's CPU GEMM can gain on this machine. ``same_tokens`` is the share of rows whose greedy
tokens equal transformers' (random weights have near-ties that float rounding may flip
late in a row).
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

    # The matrix products of the decode steps alone, on the same weights: every linear
    # layer (the LM head included, all but the embedding lookup) applied to a [batch, in]
    # input once per new token, through the same torch kernel the decoders call (prefill and
    # attention not counted).
    linears = [m.weight for m in native.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {
        w.shape[1]: torch.randn(args.batch, w.shape[1], device=args.device, dtype=dtype)
        for w in linears
    }

    @torch.no_grad()
    def matmuls_alone() -> None:
        for _ in range(new):
            for w in linears:
                torch.nn.functional.linear(inputs[w.shape[1]], w)

    runs: dict[str, Callable[[], torch.Tensor | None]] = {
        "transformers": theirs,
        "temper eager": lambda: ours(False),
        "temper compiled": lambda: ours(True),
        "matmuls alone": matmuls_alone,
    }
    start = time.perf_counter()
    ours(True)
    sync()
    compile_s = time.perf_counter() - start
    clocks = {"wall": time.perf_counter, "cpu": time.process_time}
    times = {(name, clock): [] for name in runs for clock in clocks}
    tokens: dict[str, torch.Tensor | None] = {}
    for _ in range(args.rounds):
        for name, run in runs.items():
            sync()
            starts = {clock: read() for clock, read in clocks.items()}
            tokens[name] = run()
            sync()
            for clock, read in clocks.items():
                times[name, clock].append(read() - starts[clock])
    reference = tokens["transformers"]
    seconds = {key: statistics.median(values) for key, values in times.items()}
    print(
        f"batch {args.batch} x {new} new tokens, Llama dim {args.dim} x {args.layers} layers, "
        f"vocab {args.vocab}, {args.device} {args.dtype}, {args.threads} threads; "
        f"compile_s {compile_s:.1f}"
    )
    print(
        "| decoder | wall s | CPU s | new tokens/s (CPU) | vs transformers (CPU) "
        "| vs transformers (wall) | same_tokens |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in runs:
        wall, cpu = seconds[name, "wall"], seconds[name, "cpu"]
        out = tokens[name]
        same = "-" if out is None else f"{(out == reference).all(dim=1).float().mean():.2f}"
        print(
            f"| {name} | {wall:.2f} | {cpu:.2f} | {args.batch * new / cpu:.0f} "
            f"| {seconds['transformers', 'cpu'] / cpu:.2f}x "
            f"| {seconds['transformers', 'wall'] / wall:.2f}x | {same} |"
        )


if __name__ == "__main__":
    main()
