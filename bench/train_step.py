"""Training-step benchmark: Temper's native model against `transformers` on the same weights.

    python -m bench.train_step                       # every built-in case, CPU
    python -m bench.train_step --cases llama3-20m --seq-len 512 --steps 5

For each case one random HF model is saved to a temp folder; Temper loads it with
`load_hf`, `transformers` with `from_pretrained`, so both train from the same
weights on the same batch with the same AdamW. Each side runs in a fresh child
process so its peak memory (max resident set on CPU, allocator peak on CUDA) is
its own. Prints a Markdown table with tokens/s and peak memory and their ratios.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Case:
    name: str
    hf_config: dict[str, Any]


CASES = {
    case.name: case
    for case in [
        Case(
            "llama3-20m",
            dict(
                model_type="llama",
                vocab_size=32000,
                hidden_size=384,
                intermediate_size=1024,
                num_hidden_layers=6,
                num_attention_heads=6,
                num_key_value_heads=2,
                tie_word_embeddings=True,
            ),
        ),
        Case(
            "llama3-60m",
            dict(
                model_type="llama",
                vocab_size=32000,
                hidden_size=640,
                intermediate_size=1792,
                num_hidden_layers=8,
                num_attention_heads=10,
                num_key_value_heads=5,
                tie_word_embeddings=False,
            ),
        ),
    ]
}


def make_hf_folder(case: Case, folder: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**case.hf_config)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def measure(side: str, folder: str, batch: int, seq_len: int, steps: int, device: str) -> dict:
    """Warm up one step, then time `steps` optimizer steps; runs in a child process."""
    torch.manual_seed(0)
    dev = torch.device(device)
    rss_before = _rss_gib()
    if side == "temper":
        from temper.models import load_hf

        model = load_hf(folder, device=dev)

        def logits_of(ids: torch.Tensor) -> torch.Tensor:
            return model(ids)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").to(dev)

        def logits_of(ids: torch.Tensor) -> torch.Tensor:
            return model(ids).logits

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = model.config.vocab_size if side == "hf" else model.args.vocab_size
    batch_rng = torch.Generator().manual_seed(0)  # loading consumes the global RNG differently
    ids = torch.randint(0, vocab, (batch, seq_len + 1), generator=batch_rng).to(dev)

    def step() -> float:
        logits = logits_of(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    first_loss = step()
    _sync(dev)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(dev)
    elapsed = time.perf_counter() - start
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev) / 2**30
    else:
        peak = _rss_gib() - rss_before
    return {
        "tokens_per_second": batch * seq_len * steps / elapsed,
        "peak_gib": peak,
        "first_loss": first_loss,
    }


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _in_child(*args: Any) -> dict:
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(measure, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    print(
        f"device {args.device}, fp32, batch {args.batch} x seq {args.seq_len}, "
        f"{args.steps} timed steps after one warm-up, torch {torch.__version__}\n"
    )
    columns = ["Temper tok/s", "HF tok/s", "speed ratio", "Temper peak GiB", "HF peak GiB"]
    print("| case | " + " | ".join(columns) + " | memory ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in args.cases.split(","):
        case = CASES[name]
        with tempfile.TemporaryDirectory() as folder:
            make_hf_folder(case, Path(folder))
            common = (folder, args.batch, args.seq_len, args.steps, args.device)
            ours, theirs = _in_child("temper", *common), _in_child("hf", *common)
        if abs(ours["first_loss"] - theirs["first_loss"]) > 1e-3 * abs(theirs["first_loss"]):
            raise RuntimeError(f"{name}: the two models disagree: {ours} vs {theirs}")
        print(
            f"| {name} | {ours['tokens_per_second']:,.0f} | {theirs['tokens_per_second']:,.0f} "
            f"| {ours['tokens_per_second'] / theirs['tokens_per_second']:.2f}x "
            f"| {ours['peak_gib']:.2f} | {theirs['peak_gib']:.2f} "
            f"| {ours['peak_gib'] / theirs['peak_gib']:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
