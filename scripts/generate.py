"""Try a model from the shell: greedy or sampled continuations of one or more prompts.

    python scripts/generate.py --hf exports/run --prompt "Once upon a time"
    python scripts/generate.py --checkpoint outputs/run/checkpoints/step-100 \\
        --prompt "Once upon a time" --prompt "The answer is" --temperature 0.8 --top-p 0.95

The tokenizer comes from the HF folder, or from the checkpoint's ``temper.json`` (the built-in
one when it names none). Each prompt's continuation is printed up to EOS, which is left out.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from temper.checkpoint.convert import load_for_inference
from temper.generation import generate
from temper.generation.sampling import check_sampling
from temper.utils.device import resolve_dtype


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/generate.py", description=__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", type=Path, help="an HF model folder (with tokenizer files)")
    source.add_argument("--checkpoint", type=Path, help="a temper step-<N> checkpoint folder")
    parser.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    args = parser.parse_args(argv)
    try:
        check_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as err:
        parser.error(str(err))

    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    try:
        model, tokenizer = load_for_inference(args.hf, args.checkpoint, device, dtype)
    except ValueError as err:
        parser.error(str(err))
    out = generate(
        model,
        [tokenizer.encode(prompt) for prompt in args.prompt],
        args.max_new_tokens,
        args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        stop_tokens={tokenizer.eos_id},
        pad_id=tokenizer.eos_id if tokenizer.pad_id is None else tokenizer.pad_id,
        generator=torch.Generator(device).manual_seed(args.seed),
    )
    for row, length in zip(out.tokens.tolist(), out.lengths.tolist(), strict=True):
        ids = row[:length]
        print(tokenizer.decode(ids[:-1] if ids[-1] == tokenizer.eos_id else ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
