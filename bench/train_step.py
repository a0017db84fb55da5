"""Training-step benchmark: Temper's native model against `transformers` on the same weights.

    python -m bench.train_step                                  # this device's cases
    python -m bench.train_step --cases qwen3-50m --seq-len 1024 --steps 3
    python -m bench.train_step --device cuda --dtype bfloat16 --cases llama3-8b-4l

For each case one random HF model is saved to a temp folder; Temper loads it with
`load_hf`, `transformers` with `from_pretrained`, so both train from the same
weights on the same batch with the same fused AdamW (bf16 runs use autocast on both
sides, fp32 master weights). Temper trains as its trainer does: its model and its
`CausalLM` objective take the same resolved `Kernels` (every op compiled on CPU, the
dispatcher's auto choices (Triton) on CUDA, or the references with `--kernels reference`),
so its loss is the fused linear cross-entropy. `transformers`
computes full logits and `cross_entropy` on them, as its own loss does (plus the
router's aux loss for MoE). Each side runs in a fresh process so its peak memory is
its own: on CPU the peak resident set during the timed steps minus the resident set
before the model existed; on CUDA the allocator's peak. The two processes take turns,
one step each, while the other waits, so load from anything else on the machine falls
on both alike; tokens/s is each side's fastest step, in wall-clock time and (CPU) in the
process's own CPU time (`time.process_time`): with `--threads 1` on a shared machine the CPU
time is what the step cost, where the wall time adds the waits for a core. MFU is the
model's training FLOPs per token (`flops_per_token`) times tokens/s over
`temper.utils.peak_flops` of the device (measured by a matmul probe on CPU). `--profile` then
profiles one more step of each side and prints where its self CPU time goes: matrix products
(the LM head's apart), triangular solves, attention, the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

SIDES = ("temper", "hf")


@dataclass(frozen=True)
class Case:
    name: str
    device: str
    """The device type the case is sized for; the default case list is this device's."""
    hf_config: dict[str, Any]


_QWEN3_SMALL = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1536,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    tie_word_embeddings=True,
)
_LLAMA3_8B = dict(
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)

CASES = {
    case.name: case
    for case in [
        Case(
            "llama3-20m",
            "cpu",
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
            "cpu",
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
        # The CPU target: Qwen3-shaped (q/k norms, GQA, tied), 48M parameters, 32K vocab.
        Case("qwen3-50m", "cpu", dict(model_type="qwen3", num_hidden_layers=10, **_QWEN3_SMALL)),
        # 98M parameters, about 32M active: 16 experts, top 2, every layer sparse.
        Case(
            "qwen3-moe-100m",
            "cpu",
            dict(
                model_type="qwen3_moe",
                num_hidden_layers=8,
                moe_intermediate_size=384,
                num_experts=16,
                num_experts_per_tok=2,
                norm_topk_prob=True,
                output_router_logits=True,
                **_QWEN3_SMALL,
            ),
        ),
        # Qwen3.5-MoE-shaped, 53M parameters: 6 Gated DeltaNet layers (4 key heads on 8
        # value heads) and 2 gated-attention ones, 8 experts top 2 plus a gated shared expert.
        Case(
            "qwen3.5-moe-50m",
            "cpu",
            dict(
                model_type="qwen3_5_moe_text",
                vocab_size=32000,
                hidden_size=512,
                num_hidden_layers=8,
                num_attention_heads=8,
                num_key_value_heads=2,
                head_dim=64,
                linear_num_key_heads=4,
                linear_num_value_heads=8,
                linear_key_head_dim=64,
                linear_value_head_dim=64,
                moe_intermediate_size=256,
                shared_expert_intermediate_size=256,
                num_experts=8,
                num_experts_per_tok=2,
                output_router_logits=True,
                tie_word_embeddings=True,
            ),
        ),
        # Llama 3 8B's layers, embedding and head; 4 of its 32 layers fit one GPU with AdamW.
        Case("llama3-8b-4l", "cuda", dict(num_hidden_layers=4, **_LLAMA3_8B)),
        Case(
            "qwen3-moe-30b-a3b-4l",
            "cuda",
            dict(
                model_type="qwen3_moe",
                vocab_size=151936,
                hidden_size=2048,
                intermediate_size=6144,
                moe_intermediate_size=768,
                num_experts=128,
                num_experts_per_tok=8,
                num_hidden_layers=4,
                num_attention_heads=32,
                num_key_value_heads=4,
                head_dim=128,
                norm_topk_prob=True,
                output_router_logits=True,
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


def measure(
    side: str,
    turns: Barrier,
    folder: str,
    batch: int,
    seq_len: int,
    steps: int,
    device: str,
    dtype: str,
    kernels: str,
    compile_blocks: bool,
    threads: int | None,
    profile: bool,
) -> dict:
    """One side's run, in its own process: a warm-up step, then `steps` timed steps taken in
    turns with the other side (``turns``), so both meet the same load on a shared machine;
    with ``profile`` one more step, in turn, under `torch.profiler` (`step_profile`)."""
    torch.manual_seed(0)
    if threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    rss_before = _rss_gib()
    if side == "temper":
        from temper.kernels.dispatch import OPS, REFERENCE, Kernels, resolve_kernels
        from temper.models import load_hf
        from temper.objectives import CausalLM

        choices = {
            "auto": Kernels(),
            "compile": Kernels(**dict.fromkeys(OPS, "compile")),
            "reference": REFERENCE,
        }
        run_kernels = resolve_kernels(choices[kernels], dev)
        model = load_hf(folder, device=dev)
        model.use_kernels(run_kernels)
        if compile_blocks:
            from temper.parallel.compile import apply_compile

            apply_compile(model.layers)
        objective = CausalLM(kernels=run_kernels)
        vocab = model.args.vocab_size

        def loss_of(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            loss_sum, n_tokens, _ = objective.loss(model, {"input_ids": ids, "labels": labels})
            return loss_sum / n_tokens
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").to(dev)
        vocab = model.config.vocab_size
        aux_coef = getattr(model.config, "router_aux_loss_coef", 0.0)

        def loss_of(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            out = model(ids)
            loss = F.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten())
            if getattr(out, "aux_loss", None) is not None:
                loss = loss + aux_coef * out.aux_loss
            return loss

    model.train()
    # fused=True: transformers' Trainer default (adamw_torch_fused) for torch >= 2.8.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batch_rng = torch.Generator().manual_seed(0)  # loading consumes the global RNG differently
    ids = torch.randint(0, vocab, (batch, seq_len + 1), generator=batch_rng).to(dev)
    autocast = (
        torch.autocast(dev.type, dtype=torch.bfloat16)
        if dtype == "bfloat16"
        else contextlib.nullcontext()
    )

    def step() -> float:
        with autocast:
            loss = loss_of(ids[:, :-1], ids[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    first_loss = step()
    _sync(dev)
    turns.wait()  # both sides warmed up (and compiled) before any timing
    _reset_peak(dev)
    times, cpu_times = [], []
    for _ in range(steps):
        for turn in SIDES:
            if turn == side:
                start, cpu_start = time.perf_counter(), time.process_time()
                step()
                _sync(dev)
                times.append(time.perf_counter() - start)
                cpu_times.append(time.process_time() - cpu_start)
            turns.wait()
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev) / 2**30
    else:
        peak = _peak_rss_gib() - rss_before
    breakdown = None
    if profile:  # after the peak is read: the profiler's records take memory too
        for turn in SIDES:
            if turn == side:
                breakdown = step_profile(step, vocab)
            turns.wait()
    flops = model.flops_per_token(seq_len) if side == "temper" else None
    return {
        "tokens_per_second": batch * seq_len / min(times),
        "cpu_tokens_per_second": batch * seq_len / min(cpu_times),
        "peak_gib": peak,
        "first_loss": first_loss,
        "flops_per_token": flops,
        "params": sum(p.numel() for p in model.parameters()),
        "profile": breakdown,
    }


MATRIX_PRODUCTS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::_grouped_mm"}
PROFILE_ROWS = (
    "matrix products",
    "  of which the LM head",
    "triangular solves",
    "attention",
    "everything else",
    "step (self time)",
)


def step_profile(step: Callable[[], float], vocab: int) -> dict[str, float]:
    """Self CPU seconds of one step by kind of work (`PROFILE_ROWS`): the matrix products
    (those with a vocabulary-sized operand are the LM head's), the chunked rule's triangular
    solves, attention, and the rest (element-wise work, compiled or not, and overheads).
    Self times do not overlap: all rows but the LM head's add up to the step. CPU time, so
    on CUDA it shows what the host spends, not the kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    seconds = dict.fromkeys(PROFILE_ROWS, 0.0)
    for event in prof.key_averages(group_by_input_shape=True):
        t = event.self_cpu_time_total / 1e6
        seconds["step (self time)"] += t
        if event.key in MATRIX_PRODUCTS:
            seconds["matrix products"] += t
            if any(vocab in shape for shape in event.input_shapes):
                seconds["  of which the LM head"] += t
        elif event.key == "aten::linalg_solve_triangular":
            seconds["triangular solves"] += t
        elif "scaled_dot_product" in event.key:
            seconds["attention"] += t
        else:
            seconds["everything else"] += t
    return seconds


def _status_gib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _rss_gib() -> float:
    return _status_gib("VmRSS")


def _peak_rss_gib() -> float:
    return _status_gib("VmHWM")


def _reset_peak(device: torch.device) -> None:
    """Peaks from here on: the warm-up step (and any compilation in it) is not counted."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_sides(
    sides: tuple[str, ...],
    measure: Callable[..., dict],
    make_turns: Callable[[Any], Any],
    *args: Any,
) -> dict[str, dict]:
    """Each side's ``measure(side, turns, *args)`` at once, in fresh processes (each peak
    memory is its own), taking turns through ``make_turns(context)``'s object; a side that
    fails calls its ``abort()`` to release the other instead of leaving it waiting."""
    ctx = mp.get_context("spawn")
    turns, results = make_turns(ctx), ctx.Queue()
    procs = [
        ctx.Process(target=_side_main, args=(side, measure, turns, results, *args))
        for side in sides
    ]
    for proc in procs:
        proc.start()
    out = dict(results.get() for _ in procs)
    for proc in procs:
        proc.join()
    failed = {side: r["error"] for side, r in out.items() if "error" in r}
    if failed:
        raise RuntimeError(f"benchmark failed: {failed}")
    return out


def _turn_barrier(ctx: Any) -> Barrier:
    """Both sides meet at it before each timed step (train_step's turns)."""
    return ctx.Barrier(len(SIDES))


def _side_main(
    side: str, measure: Callable[..., dict], turns: Any, results: Queue, *args: Any
) -> None:
    try:
        results.put((side, measure(side, turns, *args)))
    except Exception:
        turns.abort()
        results.put((side, {"error": traceback.format_exc()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cases", help="comma-separated case names (default: the device's)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", default="256", help="comma-separated sequence lengths")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument(
        "--kernels",
        choices=["auto", "compile", "reference"],
        default=None,
        help="Temper's kernel choices: auto (Triton on CUDA), every op compiled (the CPU "
        "default here), or every reference and full logits",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also torch.compile Temper's decoder blocks, as --compile.enable does",
    )
    parser.add_argument(
        "--threads", type=int, help="torch's CPU threads in each side (default: torch's own)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the timed steps, profile one more step per side and print where its "
        "self CPU time goes, by kind of work (the kernels' time on CPU runs only)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    args.kernels = args.kernels or ("auto" if device.type == "cuda" else "compile")
    names = args.cases.split(",") if args.cases else [
        name for name, case in CASES.items() if case.device == device.type
    ]  # fmt: skip

    from temper.utils.peak_flops import peak_flops

    peak = peak_flops(device, getattr(torch, dtype))
    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        hardware = f"{args.threads or torch.get_num_threads()} threads"
    print(
        f"device {device} ({hardware}), {dtype}, batch {args.batch}, fastest of {args.steps} "
        f"steps each after one warm-up, Temper kernels {args.kernels}"
        f"{' + compiled blocks' if args.compile else ''}, torch {torch.__version__}, "
        f"peak {peak / 1e12 if peak else float('nan'):.2f} TFLOP/s\n"
    )
    columns = ["Temper tok/s", "HF tok/s", "speed", "speed (CPU)", "Temper MFU", "HF MFU"]
    columns += ["Temper GiB", "HF GiB"]
    print("| case | params | seq | " + " | ".join(columns) + " | memory |")
    print("| --- | ---: | ---: |" + " ---: |" * (len(columns) + 1))
    for name in names:
        case = CASES[name]
        with tempfile.TemporaryDirectory() as folder:
            make_hf_folder(case, Path(folder))
            for seq_len in map(int, args.seq_len.split(",")):
                common = (folder, args.batch, seq_len, args.steps, args.device, dtype)
                runs = run_sides(
                    SIDES,
                    measure,
                    _turn_barrier,
                    *common,
                    args.kernels,
                    args.compile,
                    args.threads,
                    args.profile,
                )
                ours, theirs = runs["temper"], runs["hf"]
                _report(name, seq_len, ours, theirs, peak, dtype)
                if args.profile:
                    _report_profile(name, seq_len, ours["profile"], theirs["profile"])


def _report(
    name: str, seq_len: int, ours: dict, theirs: dict, peak: float | None, dtype: str
) -> None:
    tolerance = 1e-3 if dtype == "float32" else 2e-2
    if abs(ours["first_loss"] - theirs["first_loss"]) > tolerance * abs(theirs["first_loss"]):
        raise RuntimeError(f"{name}: the two models disagree: {ours} vs {theirs}")

    def mfu(side: dict) -> str:
        if not peak:
            return "n/a"
        return f"{100 * side['tokens_per_second'] * ours['flops_per_token'] / peak:.1f}%"

    print(
        f"| {name} | {ours['params'] / 1e6:.0f}M | {seq_len} "
        f"| {ours['tokens_per_second']:,.0f} | {theirs['tokens_per_second']:,.0f} "
        f"| {ours['tokens_per_second'] / theirs['tokens_per_second']:.2f}x "
        f"| {ours['cpu_tokens_per_second'] / theirs['cpu_tokens_per_second']:.2f}x "
        f"| {mfu(ours)} | {mfu(theirs)} "
        f"| {ours['peak_gib']:.2f} | {theirs['peak_gib']:.2f} "
        f"| {ours['peak_gib'] / theirs['peak_gib']:.2f}x |",
        flush=True,
    )


def _report_profile(name: str, seq_len: int, ours: dict, theirs: dict) -> None:
    print(f"\n{name}, seq {seq_len}, one profiled step, self CPU seconds:\n")
    print("| work | Temper s | HF s | HF - Temper s |\n| --- | ---: | ---: | ---: |")
    for row in PROFILE_ROWS:
        print(f"| {row} | {ours[row]:.2f} | {theirs[row]:.2f} | {theirs[row] - ours[row]:+.2f} |")
    print(flush=True)


if __name__ == "__main__":
    main()
