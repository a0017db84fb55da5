"""DeepSeek sparse attention's plain-PyTorch reference against dense MLA on CPU: one layer,
fp32, forward + backward, the debug flavor's shapes (dim 256, 8 heads, q/kv latents 128/64,
a 4-head indexer of 32 keeping ``--topk`` keys).

    python -m bench.dsa_reference                         # batch 1, 256 to 2048 tokens
    python -m bench.dsa_reference --seq-lens 1024 4096 --repeats 5

The reference masks dense scores, so it does all of dense MLA's work plus the indexer's
scores and the selection: this table is what the reference costs, not what a sparse kernel
would. Both layers share MLA's weights; they take turns, one step each per round, and each
time is the median over rounds. Beside: the ratio of the attention's
forward FLOPs a sparse kernel would do to dense MLA's, counting each query's keys (causal:
(s + 1) / 2 on average; sparse: min(t + 1, topk) at position t) and the indexer's scores
over every causal key (2 * index_heads * index_head_dim per query and key).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from temper.models.layers.context import ForwardContext
from temper.models.layers.mla import MLA
from temper.models.layers.rope import rope_cos_sin, rope_inv_freq
from temper.models.layers.sparse_attention import SparseMLA

DIM, HEADS, Q_RANK, KV_RANK, NOPE, ROPE, V = 256, 8, 128, 64, 32, 16, 32
INDEX_HEADS, INDEX_DIM = 4, 32


def _layers(topk: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    shape = (DIM, HEADS, Q_RANK, KV_RANK, NOPE, ROPE, V)
    sparse = SparseMLA(
        *shape,
        index_n_heads=INDEX_HEADS,
        index_head_dim=INDEX_DIM,
        index_topk=topk,
        index_rope_interleaved=False,
        softmax_scale=(NOPE + ROPE) ** -0.5,
    )
    sparse.init_weights(0.02, 0.02)
    dense = MLA(*shape, softmax_scale=(NOPE + ROPE) ** -0.5, rope_interleaved=True)
    dense.load_state_dict(sparse.state_dict(), strict=False)
    return dense, sparse


def _step(layer: nn.Module, x: torch.Tensor, ctx: ForwardContext) -> float:
    start = time.perf_counter()
    layer(x, ctx).sum().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--topk", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dense, sparse = _layers(args.topk)
    print(f"batch {args.batch}, index_topk {args.topk}, fp32, forward + backward, ms (median)")
    print(f"{'tokens':>7} {'dense MLA':>10} {'DSA ref':>10} {'ratio':>6} {'FLOPs ratio':>12}")
    for s in args.seq_lens:
        x = torch.randn(args.batch, s, DIM, requires_grad=True)
        cos, sin = rope_cos_sin(rope_inv_freq(ROPE, 10000.0, None), torch.arange(s)[None])
        ctx = ForwardContext(cos, sin)
        times: dict[str, list[float]] = {"dense": [], "sparse": []}
        for _ in range(args.repeats + 1):  # the first round warms up
            times["dense"].append(_step(dense, x, ctx))
            times["sparse"].append(_step(sparse, x, ctx))
        d, p = (statistics.median(t[1:]) * 1e3 for t in times.values())
        heads_dims = HEADS * (NOPE + ROPE + V)
        dense_keys = (s + 1) / 2  # per query, on average: the causal ones
        sparse_keys = sum(min(t + 1, args.topk) for t in range(s)) / s
        indexer = 2 * INDEX_HEADS * INDEX_DIM * dense_keys
        flops = (2 * heads_dims * sparse_keys + indexer) / (2 * heads_dims * dense_keys)
        print(f"{s:>7} {d:>10.1f} {p:>10.1f} {p / d:>6.2f} {flops:>12.2f}")


if __name__ == "__main__":
    main()
