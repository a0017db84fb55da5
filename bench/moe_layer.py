"""MoE layer benchmark: Temper's ``MoE`` against transformers' ``Qwen3MoeSparseMoeBlock``.

    python -m bench.moe_layer                                  # debug and large, 4096 tokens
    python -m bench.moe_layer --configs large --tokens 8192 --repeats 7
    python -m bench.moe_layer --configs 2048:128:8:768         # dim:experts:top_k:moe_hidden

Both layers hold the same weights: a one-layer random ``Qwen3MoeForCausalLM`` is saved with
``save_pretrained`` and Temper reads it with ``load_hf`` (the qwen3_moe adapter's expert
mapping), as bench.train_step does. One forward + backward of each on the same tokens, fp32.

Timed implementations, all in one process:

- Temper ``reference``: the MoE ops' plain-PyTorch references (``REFERENCE``);
- Temper ``compile``: ``--kernels.swiglu compile --kernels.moe_permute compile``.
  The grouped GEMM has no kernel switch: ``torch._grouped_mm`` where it runs (CPU fp32/bf16
  eager, CUDA bf16), else the per-expert loop.
  The row marked "default" is what a training run's ``Kernels()`` resolves to on this device;
- HF ``eager``: the block's own loop over the experts that got tokens;
- HF ``grouped_mm``: ``torch._grouped_mm``, what ``from_pretrained`` picks by default.

Before any timing the outputs and input gradients of every implementation must agree with HF
eager, or the run stops (that step is also the warm-up). The implementations take turns, one
step each per round, so load from other processes falls on all of them alike; each time is
the median over rounds. Peak memory is the rise of the peak resident set during one more step
of each from no gradients, measured after the timing with every allocation of 64 KiB and up
mmap-ed (so freed memory leaves the resident set and each step's peak is its own).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from bench.train_step import _peak_rss_gib, _reset_peak, _rss_gib
from temper.kernels.dispatch import REFERENCE, Kernels, resolve_kernels
from temper.models import load_hf
from temper.models.layers.context import ForwardContext
from temper.models.qwen3_moe.args import FLAVORS


@dataclass(frozen=True)
class Shape:
    dim: int
    n_experts: int
    top_k: int
    moe_hidden: int

    def __str__(self) -> str:
        return (
            f"dim {self.dim}, {self.n_experts} experts top-{self.top_k}, "
            f"moe_hidden {self.moe_hidden}"
        )


_DEBUG = FLAVORS["debug"]
SHAPES = {
    "debug": Shape(_DEBUG.dim, _DEBUG.n_experts, _DEBUG.top_k, _DEBUG.moe_hidden_dim),
    "large": Shape(1024, 64, 8, 256),
}

MOE_OPS = ("swiglu", "moe_permute")
"""The dispatcher's ops inside an MoE layer."""
TEMPER = {
    "temper reference": REFERENCE,
    "temper compile": Kernels(**dict.fromkeys(MOE_OPS, "compile")),
}
HF_DEFAULT = "hf grouped_mm"
CPU = torch.device("cpu")


def temper_default() -> str:
    """The TEMPER entry whose MoE ops a training run's default ``Kernels()`` resolves to."""
    default = resolve_kernels(Kernels(), CPU)
    resolved = {op: getattr(default, op) for op in MOE_OPS}
    for name, kernels in TEMPER.items():
        if all(getattr(kernels, op) == impl for op, impl in resolved.items()):
            return name
    raise RuntimeError(f"the default kernels resolve to {resolved}, which no row times")


def parse_shape(name: str) -> Shape:
    if name in SHAPES:
        return SHAPES[name]
    try:
        dim, experts, top_k, hidden = map(int, name.split(":"))
    except ValueError as err:
        raise SystemExit(
            f"unknown config {name!r}: {', '.join(SHAPES)} or dim:experts:top_k:hidden"
        ) from err
    return Shape(dim, experts, top_k, hidden)


def build_pair(shape: Shape) -> tuple[nn.Module, nn.Module, nn.Module]:
    """Temper's MoE and HF's block with the same weights, plus the HF model that owns the block
    (its ``set_experts_implementation`` switches the block's expert forward)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()  # save_pretrained's bar would land in the printed table

    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=shape.dim,
        intermediate_size=shape.moe_hidden,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=shape.n_experts,
        num_experts_per_tok=shape.top_k,
        moe_intermediate_size=shape.moe_hidden,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    hf_model = Qwen3MoeForCausalLM(config)
    with tempfile.TemporaryDirectory() as folder:
        hf_model.save_pretrained(folder)
        ours = load_hf(Path(folder))
    return ours.layers[0].feed_forward.train(), hf_model.model.layers[0].mlp.train(), hf_model


class WithKernels(nn.Module):
    """Temper's MoE layer run with ``kernels`` in its forward context, as a decoder runs it."""

    def __init__(self, moe: nn.Module, kernels: Kernels) -> None:
        super().__init__()
        self.moe = moe
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        no_rotary = x.new_empty(0)
        return self.moe(x, ForwardContext(no_rotary, no_rotary, kernels=self.kernels))


@dataclass(frozen=True)
class Impl:
    """One implementation: ``select`` switches ``layer`` to it (untimed, before each step)."""

    select: Callable[[], None]
    layer: nn.Module
    x: torch.Tensor
    cotangent: torch.Tensor

    def release(self) -> None:
        """Drop the last step's gradients, so that the next step starts from none."""
        self.layer.zero_grad(set_to_none=True)
        self.x.grad = None

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward + backward: the output and the input gradient."""
        self.release()
        out = self.layer(self.x)
        out.backward(self.cotangent)
        return out.detach(), self.x.grad

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.select()
        return self.step()


def implementations(shape: Shape, tokens: int) -> dict[str, Impl]:
    ours, theirs, hf_model = build_pair(shape)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, tokens, shape.dim, generator=gen).requires_grad_()
    cotangent = torch.randn(1, tokens, shape.dim, generator=gen)
    impls = {
        name: Impl(lambda: None, WithKernels(ours, kernels), x, cotangent)
        for name, kernels in TEMPER.items()
    }
    for name in ("eager", "grouped_mm"):
        impls[f"hf {name}"] = Impl(
            lambda n=name: hf_model.set_experts_implementation(n), theirs, x, cotangent
        )
    return impls


def check_agreement(impls: dict[str, Impl], rtol: float) -> None:
    """Every implementation's output and input gradient within ``rtol`` (relative to the
    largest entry) of HF eager's, before anything is timed."""
    expected = impls["hf eager"].run()
    for name, impl in impls.items():
        for what, got, want in zip(("output", "input grad"), impl.run(), expected, strict=True):
            err = ((got - want).abs().max() / want.abs().max()).item()
            if not err <= rtol:
                raise RuntimeError(f"{name} disagrees with hf eager: {what} off by {err:.1e}")


def time_in_turns(impls: dict[str, Impl], repeats: int) -> dict[str, float]:
    """Median ms per step over ``repeats`` rounds, each running every implementation once, so
    a load spike hits all alike. ``check_agreement`` was the warm-up (and compiled)."""
    times: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(repeats):
        for name, impl in impls.items():
            impl.select()
            start = time.perf_counter()
            impl.step()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def peak_mib(impls: dict[str, Impl]) -> dict[str, float]:
    """Each step's rise of the peak resident set above the resident set before it (MiB), from
    no gradients: the weight gradients (the same size on both sides) count."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: 64 KiB and up is mmap-ed, freed at once
    peaks = {}
    for name, impl in impls.items():
        impl.select()
        impl.release()
        gc.collect()
        libc.malloc_trim(0)
        before = _rss_gib()
        _reset_peak(CPU)
        impl.step()
        peaks[name] = 1024 * (_peak_rss_gib() - before)
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs",
        default="debug,large",
        help="names or dim:experts:top_k:hidden, comma-separated",
    )
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rtol", type=float, default=1e-5, help="agreement check (relative)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory step")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    default = temper_default()
    print(
        f"cpu fp32, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"{args.tokens} tokens, fwd+bwd median of {args.repeats} rounds in turns; "
        f"speed = {HF_DEFAULT} ms / this ms\n"
    )
    print("| config | implementation | fwd+bwd ms | speed | peak MiB |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name in args.configs.split(","):
        shape = parse_shape(name)
        impls = implementations(shape, args.tokens)
        check_agreement(impls, args.rtol)
        ms = time_in_turns(impls, args.repeats)
        peaks = {} if args.no_memory else peak_mib(impls)
        for impl in impls:
            label = f"{impl} (default)" if impl in (default, HF_DEFAULT) else impl
            peak = f"{peaks[impl]:.0f}" if impl in peaks else "n/a"
            print(
                f"| {name} ({shape}) | {label} | {ms[impl]:.1f} "
                f"| {ms[HF_DEFAULT] / ms[impl]:.2f}x | {peak} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
