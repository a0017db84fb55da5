"""Packing benchmark: how full the SFT packer's rows are (real tokens / positions computed),
by lookahead buffer, on conversations of seeded random lengths.

    python -m bench.packing                          # 100-400 tokens, 1024-token rows
    python -m bench.packing --seq-len 512 --rows 2000 --buffers 1 16 64 256

Each conversation is a sample of a length drawn uniformly from ``--min-tokens`` to
``--max-tokens`` (the chat template's tokens included: what ``SFTFormat.encode`` returns),
its tokens random and every label trained, so only the lengths matter. The samples go
through the packer the training stream uses (``temper.data.sft.sft_packer``) until
``--rows`` rows are made; the fill counts the real tokens of those rows (their
``real_tokens``) over ``rows * seq_len``. Buffer 1 is the previous packer (whole samples in
reading order, a new row when the next does not fit).
"""

from __future__ import annotations

import argparse
import random

from temper.data.batch import REAL_TOKENS
from temper.data.sft import Sample, sft_packer


class RandomLengths:
    """An endless lane reader of samples whose lengths are uniform in [low, high]."""

    def __init__(self, low: int, high: int, seed: int) -> None:
        self.low, self.high = low, high
        self.rng = random.Random(seed)
        self.ahead: Sample | None = None

    def peek(self) -> Sample:
        if self.ahead is None:
            n = self.rng.randint(self.low, self.high)
            self.ahead = ([self.rng.randrange(1, 1000) for _ in range(n)], [True] * n)
        return self.ahead

    def take(self) -> Sample:
        sample = self.peek()
        self.ahead = None
        return sample


def fill(seq_len: int, buffer: int, rows: int, low: int, high: int, seed: int) -> float:
    """Real tokens over computed positions of ``rows`` packed rows."""
    packer = sft_packer(seq_len, fill=0, pack=True, buffer=buffer)
    reader = RandomLengths(low, high, seed)
    real = sum(int(packer.row(reader)[REAL_TOKENS]) for _ in range(rows))
    return real / (rows * seq_len)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.packing", description=__doc__)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--min-tokens", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--buffers", type=int, nargs="+", default=[1, 8, 16, 64, 256])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(
        f"conversations of {args.min_tokens}-{args.max_tokens} tokens, rows of {args.seq_len}, "
        f"{args.rows} rows"
    )
    print("| data.pack_buffer | packing efficiency |\n| --- | --- |")
    for buffer in args.buffers:
        value = fill(args.seq_len, buffer, args.rows, args.min_tokens, args.max_tokens, args.seed)
        print(f"| {buffer} | {100 * value:.1f}% |")


if __name__ == "__main__":
    main()
