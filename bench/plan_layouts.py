"""What the large recipes need per GPU at a few layouts, from the dry run (``temper.plan``),
in one CPU process: the table of docs/observability.md.

    python -m bench.plan_layouts

Each row plans the recipe (with the row's overrides) for its world size on cuda (bf16
compute, fused AdamW) and shows the busiest rank; the last column is the plan's wall time.
"""

from __future__ import annotations

import argparse
import time

import temper.engine  # noqa: F401  (registers the built-in rules)
from temper.config import load_config
from temper.plan import plan_run

GIB = 2**30

RECIPES = {
    "deepseek_v3_671b": ("temper.recipes.deepseek_v3", "deepseek_v3_671b", ""),
    "qwen3_235b_a22b": ("temper.recipes.qwen3", "qwen3_30b_a3b", "--model.flavor 235b_a22b"),
    "qwen3_5_397b_a17b": (
        "temper.recipes.qwen3_5",
        "qwen3_5_35b_a3b_sft",
        "--model.flavor 397b_a17b",
    ),
}
"""Each planned model: the recipe it starts from and the flavor override (Qwen3-235B-A22B on
the Qwen3-30B-A3B recipe, Qwen3.5-397B-A17B on the Qwen3.5-35B-A3B SFT recipe)."""

FLAGS = {
    "ep": "--parallelism.ep",
    "ac": "--activation_checkpoint.mode",
    "seq": "--training.seq_len",
    "gbs": "--training.global_batch_size",
}

LAYOUTS = [
    ("deepseek_v3_671b", 256, "ep 64 ac full"),
    ("deepseek_v3_671b", 256, "ep 32 ac full"),
    ("deepseek_v3_671b", 256, "ep 64 ac selective"),
    ("deepseek_v3_671b", 128, "ep 64 ac full"),
    ("qwen3_235b_a22b", 64, "ep 8 ac full"),
    ("qwen3_235b_a22b", 64, "ep 16 ac full seq 4096"),
    ("qwen3_235b_a22b", 32, "ep 8 ac full"),
    ("qwen3_5_397b_a17b", 64, "ep 16 ac full"),
    ("qwen3_5_397b_a17b", 128, "ep 32 ac full gbs 128"),
    ("qwen3_5_397b_a17b", 64, "ep 16 ac selective"),
]
"""(model, GPUs, layout): the layout's words are ``name value`` pairs of FLAGS."""


def overrides_of(model: str, layout: str) -> list[str]:
    words = layout.split()
    flags = [f"{FLAGS[k]} {v}" for k, v in zip(words[::2], words[1::2], strict=True)]
    return " ".join([RECIPES[model][2], *flags]).split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(RECIPES), help="comma-separated")
    models = parser.parse_args().models.split(",")
    print(
        "| model | GPUs | layout | params + grads + optimizer | activations | gathered "
        "| peak per GPU (GiB) | all-gather / reduce-scatter / all-to-all EP per step (GiB) "
        "| plan time (s) |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: |", flush=True)
    for model, world, layout in LAYOUTS:
        if model not in models:
            continue
        start = time.perf_counter()
        module, recipe, _ = RECIPES[model]
        config = load_config(module, recipe, overrides_of(model, layout), validate=False)
        plan = plan_run(config, world, "cuda")
        seconds = time.perf_counter() - start
        if plan.errors:
            print(f"| {model} | {world} | {layout} | error: {'; '.join(plan.errors)} |")
            continue
        worst = max(plan.ranks, key=lambda r: r.peak)
        state = worst.state.params + worst.state.grads + worst.state.optimizer
        comm = plan.communication
        assert comm is not None
        print(
            f"| {model} | {world} | {layout} | {state / GIB:.1f} | "
            f"{worst.activations / GIB:.1f} | {worst.gathered / GIB:.1f} | "
            f"{worst.peak / GIB:.1f} | "
            f"{comm.all_gather / GIB:.0f} / {comm.reduce_scatter / GIB:.0f} / "
            f"{comm.all_to_all_ep / GIB:.0f} | {seconds:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
