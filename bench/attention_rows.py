"""CPU attention, forward + backward: one sdpa call against the same call in row chunks.

    python -m bench.attention_rows                       # 4096 tokens a batch, seq 512-4096
    python -m bench.attention_rows --seq-lens 1024 --repeats 7
    python -m bench.attention_rows --seq-lens 1024 --rows 128 256   # chunk sizes side by side

torch's CPU flash kernel skips masked-out work only in whole 512-key blocks, and none under
an explicit mask; ``row_chunked`` runs chunks of ``CPU_QUERY_ROWS`` queries over the keys
they can see. Heads as bench.train_step's qwen3-50m (8 query heads, 4 KV heads of 64), fp32;
"packed" rows hold documents of 300 tokens. The two forms alternate, median of ``repeats``.
This is the measurement behind the CPU ``sdpa`` path's choice (docs/packing.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from temper.kernels.attention import CPU_QUERY_ROWS, DocumentMask, row_chunked

HEADS, KV_HEADS, HEAD_DIM, DOCUMENT = 8, 4, 64, 300


def forms(
    seq_len: int, tokens: int, packed: bool, chunk_rows: list[int]
) -> dict[str, Callable[[], None]]:
    """The one-call reference and the row chunks of each size in ``chunk_rows``, each as
    ``step()``: forward and backward."""
    batch = max(1, tokens // seq_len)
    q, k, v = (
        torch.randn(batch, seq_len, heads, HEAD_DIM, requires_grad=True)
        for heads in (HEADS, KV_HEADS, KV_HEADS)
    )
    upstream = torch.randn(batch, seq_len, HEADS, HEAD_DIM)
    docs = None
    if packed:
        positions = torch.arange(seq_len) % DOCUMENT
        docs = DocumentMask.from_position_ids(positions.expand(batch, seq_len))
    mask = docs.dense() if packed else None

    def one_call() -> None:
        heads_first = (t.transpose(1, 2) for t in (q, k, v))
        F.scaled_dot_product_attention(
            *heads_first, attn_mask=mask, is_causal=mask is None, enable_gqa=True
        ).transpose(1, 2).backward(upstream)

    def chunks(rows: int) -> Callable[[], None]:
        return lambda: row_chunked(q, k, v, docs, None, None, None, rows=rows).backward(upstream)

    return {"one call": one_call} | {f"rows of {rows}": chunks(rows) for rows in chunk_rows}


def measure(steps: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median seconds per step of each form, the forms taking turns after a warm-up."""
    for step in steps.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[CPU_QUERY_ROWS], help="query rows per chunk"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    chunk_columns = "".join(f" rows of {r} ms | / one call |" for r in args.rows)
    print(f"| rows | seq | batch | one call ms |{chunk_columns}")
    print("| --- | ---: | ---: | ---: |" + " ---: | ---: |" * len(args.rows))
    for packed in (False, True):
        for seq_len in args.seq_lens:
            step = forms(seq_len, args.tokens, packed, args.rows)
            one, *chunked = measure(step, args.repeats).values()
            kind = "packed" if packed else "causal"
            batch = max(1, args.tokens // seq_len)
            cells = "".join(f" {t * 1e3:.0f} | {t / one:.2f} |" for t in chunked)
            print(f"| {kind} | {seq_len} | {batch} | {one * 1e3:.0f} |{cells}", flush=True)


if __name__ == "__main__":
    main()
