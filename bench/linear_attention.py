"""Gated DeltaNet layer benchmark: Temper's ``GatedDeltaNet`` against transformers'
``Qwen3_5GatedDeltaNet`` (its plain-PyTorch fallback), same weights, fp32, forward + backward.

    python -m bench.linear_attention                      # batch 4 x 1024, the 50M case's layer
    python -m bench.linear_attention --batch 1 --seq-len 4096 --repeats 5

A one-layer random ``Qwen3_5ForCausalLM`` (the layer of bench.train_step's qwen3.5-moe-50m:
dim 512, 4 key heads on 8 value heads of 64) is saved with ``save_pretrained`` and Temper
reads it with ``load_hf``. Before timing, the outputs and input gradients must agree (the
run stops otherwise). The two layers take turns, one step each per round, so load from other
processes falls on both alike; each time is the median over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from torch import nn

from temper.models import load_hf


def _layers(dim: int) -> tuple[nn.Module, nn.Module]:
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=128,
        hidden_size=dim,
        intermediate_size=4 * dim,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        native = load_hf(folder)
    return native.layers[0].attention, hf.model.layers[0].linear_attn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ours, theirs = _layers(args.dim)
    x = torch.randn(args.batch, args.seq_len, args.dim, generator=torch.Generator().manual_seed(1))
    empty = torch.empty(0)
    steps: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "temper": lambda t: ours(t, empty, empty),
        "hf": lambda t: theirs(t),
    }

    def step(name: str) -> tuple[float, torch.Tensor, torch.Tensor]:
        t = x.clone().requires_grad_()
        start = time.perf_counter()
        out = steps[name](t)
        out.square().mean().backward()
        return time.perf_counter() - start, out.detach(), t.grad

    _, out_t, grad_t = step("temper")
    _, out_h, grad_h = step("hf")
    torch.testing.assert_close(out_t, out_h, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad_t, grad_h, rtol=1e-4, atol=1e-8)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name in steps:
            times[name].append(step(name)[0])
    tokens = args.batch * args.seq_len
    median = {name: statistics.median(ts) for name, ts in times.items()}
    print(
        f"Gated DeltaNet layer, dim {args.dim}, 4 key / 8 value heads of 64, batch "
        f"{args.batch} x {args.seq_len}, fp32, {torch.get_num_threads()} threads, forward + "
        f"backward, median of {args.repeats}\n"
    )
    print("| layer | ms | tokens/s | speed |")
    print("| --- | ---: | ---: | ---: |")
    for name in steps:
        speed = median["hf"] / median[name]
        print(f"| {name} | {median[name] * 1e3:.0f} | {tokens / median[name]:.0f} | {speed:.2f}x |")


if __name__ == "__main__":
    main()
