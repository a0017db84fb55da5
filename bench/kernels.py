"""Per-op timing of each fused op's implementations, forward + backward, at training shapes.

    python -m bench.kernels                    # CPU: reference vs compile
    python -m bench.kernels --device cuda      # CUDA: reference vs compile vs triton
    python -m bench.kernels --loss-chunks 256 512 1024   # the fused loss at each chunk size

This is the measurement behind the dispatcher's ``auto`` choice (docs/kernels.md). Shapes are
those of bench.train_step's qwen3-50m case at batch 4 x seq 1024 on CPU, and of Llama 3 8B at
batch 2 x seq 4096 on CUDA; the loss rows compare full logits with the chunked fused loss,
by default at the device's chunk size (``--kernels.cross_entropy_chunk 0``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from temper.config import Kernels
from temper.kernels.cross_entropy import linear_cross_entropy, linear_log_probs_reference
from temper.kernels.dispatch import Impl, unavailable
from temper.kernels.moe_permute import permute, unpermute
from temper.kernels.norm import rms_norm
from temper.kernels.rope import apply_rope
from temper.kernels.sparse_attention import sparse_attention
from temper.kernels.swiglu import swiglu
from temper.models.layers.rope import rope_cos_sin, rope_inv_freq

SPARSE_TOPK = 256
"""Keys per query of the sparse attention row (rows of 1024 tokens on CPU, 2048 on CUDA)."""
# tokens, dim, ffn hidden, heads, head_dim, vocab, experts, top_k
SHAPES = {
    "cpu": (4096, 512, 1536, 8, 64, 32000, 16, 2),
    "cuda": (8192, 4096, 14336, 32, 128, 128256, 128, 8),
}


def ops(
    device: torch.device, dtype: torch.dtype, loss_chunks: list[int]
) -> dict[str, Callable[[Impl], Callable]]:
    """Each op as ``impl -> step``, where ``step()`` runs one forward and backward; one loss
    row per chunk size in ``loss_chunks``."""
    tokens, dim, ffn, heads, head_dim, vocab, experts, top_k = SHAPES[device.type]

    def leaf(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=device) * scale).to(dtype).requires_grad_()

    def backward(out: torch.Tensor) -> None:
        out.backward(torch.ones_like(out))

    x, w = leaf(tokens, dim), leaf(dim)
    q, qw = leaf(4, tokens // 4, heads, head_dim), leaf(head_dim)
    gate, up = leaf(tokens, ffn), leaf(tokens, ffn)
    positions = torch.arange(tokens // 4, device=device)[None]
    cos, sin = rope_cos_sin(rope_inv_freq(head_dim, 10000.0).to(device), positions)
    order = torch.rand(tokens, experts, device=device).topk(top_k, -1).indices.flatten()
    order = order.argsort(stable=True)
    rows, weights = leaf(tokens * top_k, dim), leaf(tokens, top_k)
    hidden, head = leaf(tokens, dim), leaf(vocab, dim, scale=0.02)
    labels = torch.randint(0, vocab, (tokens,), device=device)
    # DeepSeek sparse attention's core: each query's SPARSE_TOPK keys of random scores among
    # its causal prefix, q's shape for q, k and v.
    k, v = leaf(*q.shape), leaf(*q.shape)
    causal = torch.ones(tokens // 4, tokens // 4, dtype=torch.bool, device=device).tril()
    scores = torch.rand(4, tokens // 4, tokens // 4, device=device).masked_fill(~causal, -1.0)
    best = scores.topk(SPARSE_TOPK, dim=-1).indices
    selected = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, best, True) & causal

    def loss(chunk: int) -> Callable[[Impl], Callable[[], None]]:
        def step(impl: Impl) -> Callable[[], None]:
            if impl == "reference":  # full logits, as an unfused loss computes them
                return lambda: (
                    -linear_log_probs_reference(hidden, head, labels)[0].sum()
                ).backward()
            return lambda: linear_cross_entropy(hidden, head, labels, 0.0, chunk, impl)[
                0
            ].backward()

        return step

    return {
        "rmsnorm": lambda impl: lambda: backward(rms_norm(x, w, 1e-6, impl)),
        "qk_norm": lambda impl: lambda: backward(rms_norm(q, qw, 1e-6, impl)),
        "swiglu": lambda impl: lambda: backward(swiglu(gate, up, impl)),
        "rope": lambda impl: lambda: backward(apply_rope(q, cos, sin, impl)),
        "moe_permute": lambda impl: lambda: backward(permute(x, order, top_k, impl)),
        "moe_unpermute": lambda impl: lambda: backward(unpermute(rows, order, weights, impl)),
        f"sparse_attention (top {SPARSE_TOPK})": lambda impl: (
            lambda: backward(sparse_attention(q, k, v, selected, head_dim**-0.5, impl))
        ),
        **{f"loss (full logits -> fused, chunk {c})": loss(c) for c in loss_chunks},
    }


def time_ms(step: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median wall time of ``repeats`` calls after two warm-ups (compilation happens there)."""
    times = []
    for i in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--loss-chunks",
        type=int,
        nargs="+",
        help="the fused loss's chunk sizes (default: the device's)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    loss_chunks = args.loss_chunks or [Kernels().chunk_tokens(device)]
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    impls: list[Impl] = [
        i for i in ("reference", "compile", "triton") if unavailable(i, device) is None
    ]
    print(f"{device} {dtype}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(
        f"shapes (tokens, dim, ffn, heads, head_dim, vocab, experts, top_k) = {SHAPES[device.type]}"
    )
    print("\n| op (fwd+bwd, ms) | " + " | ".join(impls) + " |")
    print("| --- |" + " ---: |" * len(impls))
    for name, make in ops(device, dtype, loss_chunks).items():
        cells = [f"{time_ms(make(impl), device, args.repeats):.1f}" for impl in impls]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
