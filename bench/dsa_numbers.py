"""DeepSeek sparse attention against dense MLA per layer, by count rather than by clock: the
training FLOPs Temper's MFU uses (``deepseek_v32.model.attention_flops_per_token``) and the
attention core's activation bytes, for one sequence of each length in bf16.

    python -m bench.dsa_numbers                          # deepseek_v32 671b at 8K and 32K
    python -m bench.dsa_numbers --flavor debug --seq-lens 512 2048

Memory columns, per layer and sequence: ``saved`` is what the attention core keeps for its
backward: q, k [s, heads, qk_head_dim] and v, out [s, heads, v_head_dim] in bf16 and the fp32
log-sum-exp [s, heads], the same for a flash kernel over dense MLA and for the sparse Triton
kernel, which adds its int32 key lists [s, index_topk]. ``selection`` is what DSA's choice
holds during the layer's forward: the indexer's fp32 scores and the boolean selection, both
[s, s] (the masked reference's sdpa takes that selection as its mask).
"""

from __future__ import annotations

import argparse
import dataclasses

from temper.models.deepseek_v32.args import FLAVORS
from temper.models.deepseek_v32.model import attention_flops_per_token

GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="671b", choices=sorted(FLAVORS))
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768])
    options = parser.parse_args()
    args = FLAVORS[options.flavor]
    h, qk, v, topk = args.n_heads, args.qk_head_dim, args.v_head_dim, args.index_topk
    print(
        f"deepseek_v32 {options.flavor}: {h} heads, qk {qk} / v {v} dims, indexer "
        f"{args.index_n_heads} x {args.index_head_dim}, index_topk {topk}; one layer, one "
        "sequence, bf16"
    )
    print(
        "| tokens | dense MLA TFLOP | DSA TFLOP (indexer off) | ratio | DSA TFLOP (sparse "
        "training) | saved dense (GiB) | saved DSA (GiB) | selection (GiB) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for s in options.seq_lens:
        dense_args = dataclasses.replace(args, index_topk=s, indexer_training="off")
        dense = attention_flops_per_token(dense_args, s, indexer=False) * s
        off = attention_flops_per_token(args, s, indexer=True) * s
        sparse_args = dataclasses.replace(args, indexer_training="sparse")
        training = attention_flops_per_token(sparse_args, s, indexer=True) * s
        saved = s * h * (2 * qk + 2 * v) * 2 + s * h * 4
        indices = s * min(s, topk) * 4
        selection = s * s * (4 + 1)
        print(
            f"| {s} | {dense / 1e12:.2f} | {off / 1e12:.2f} | {off / dense:.3f} | "
            f"{training / 1e12:.2f} | {saved / GIB:.2f} | {(saved + indices) / GIB:.2f} | "
            f"{selection / GIB:.2f} |"
        )


if __name__ == "__main__":
    main()
