"""Peak memory and time of `dcp-to-hf`: streaming against loading the whole model.

    python -m bench.convert_memory                          # llama3 1b and a 0.4B Qwen3-MoE
    python -m bench.convert_memory --cases moe --max-shard-gib 0.25

Each case writes a checkpoint of random bf16 weights once (built on meta, filled, saved),
then converts it to a bf16 HF folder twice, each in a fresh process: the converter before
streaming (`load_checkpoint_model`, which builds the whole fp32 model and loads the
checkpoint into it, then `save_hf`) and `dcp_to_hf`, which streams. A process's peak is its
resident set's high-water mark; "imports" is that of a process that only imports the
converter, the constant part of every figure. The streaming target: peak minus imports at
most twice the largest output shard.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CASES = {
    "1b": ("llama3", "1b", {}),
    "moe": (
        "qwen3_moe",
        "debug",
        {"dim": 1024, "n_layers": 8, "n_experts": 32, "moe_hidden_dim": 512, "top_k": 4},
    ),
}
"""name -> (family, flavor, args overrides): the 1B Llama flavor, and a Qwen3-MoE of 32
experts per layer (0.4B parameters; the debug flavor is too small to show anything)."""

WRITE = """
import sys, json, torch
from temper.checkpoint.manager import write_checkpoint
from temper.checkpoint.metadata import build_metadata, run_structure
from temper.models import build_model
from torch.distributed.checkpoint.state_dict import get_model_state_dict
family, flavor, overrides, folder = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
model = build_model(family, flavor, overrides=overrides).to(torch.bfloat16)
model.to_empty(device="cpu")
torch.manual_seed(0)
with torch.no_grad():
    for p in model.parameters():
        p.normal_(std=0.02)
structure = run_structure(ep=1, lora=None, param_dtype=torch.bfloat16)
write_checkpoint(__import__("pathlib").Path(folder), {"model": get_model_state_dict(model)},
                 build_metadata(model, step=1, structure=structure))
print(sum(p.numel() for p in model.parameters()))
"""

CONVERT = {
    "imports": "import temper.checkpoint.convert",
    "whole model": (
        "import sys, torch\nfrom pathlib import Path\n"
        "from temper.checkpoint.convert import load_checkpoint_model\n"
        "from temper.models import save_hf\n"
        "model = load_checkpoint_model(Path(sys.argv[1])).to(torch.bfloat16)\n"
        "save_hf(model, Path(sys.argv[2]), max_shard_bytes=int(sys.argv[3]))"
    ),
    "streaming": (
        "import sys\nfrom pathlib import Path\n"
        "from temper.checkpoint.convert import dcp_to_hf\n"
        "dcp_to_hf(Path(sys.argv[1]), Path(sys.argv[2]), 'bfloat16', "
        "max_shard_bytes=int(sys.argv[3]))"
    ),
}


def measure(code: str, *args: str) -> tuple[float, float, str]:
    """(peak resident set in GiB, seconds) of `code` run in a fresh Python, and its stdout."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-W", "ignore", "-c", code, *args],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    out = process.stdout.read()
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"{code.splitlines()[-1]!r} failed with {process.returncode}")
    return usage.ru_maxrss / 2**20, seconds, out  # ru_maxrss is in KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="moe,1b", help=f"comma-separated of {sorted(CASES)}")
    parser.add_argument("--max-shard-gib", type=float, default=0.5)
    parser.add_argument("--work", type=Path, default=None, help="folder for the files")
    args = parser.parse_args()
    shard_bytes = str(int(args.max_shard_gib * 2**30))
    print(
        f"bf16 checkpoint -> bf16 HF folder, shards of at most {args.max_shard_gib} GiB, "
        f"torch {torch.__version__}\n"
    )
    print(
        "| model | parameters | largest shard (GiB) | imports (GiB) | whole model: peak (GiB), "
        "time (s) | streaming: peak (GiB), time (s) | streaming peak - imports, / largest "
        "shard |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
    imports, _, _ = measure(CONVERT["imports"])
    for case in args.cases.split(","):
        family, flavor, overrides = CASES[case]
        with tempfile.TemporaryDirectory(dir=args.work) as work:
            folder = Path(work) / "step-1"
            _, _, count = measure(WRITE, family, flavor, json.dumps(overrides), str(folder))
            figures = {}
            for name in ("whole model", "streaming"):
                output = Path(work) / name.replace(" ", "_")
                figures[name] = measure(CONVERT[name], str(folder), str(output), shard_bytes)[:2]
                largest = max(p.stat().st_size for p in output.glob("*.safetensors")) / 2**30
            whole, streamed = figures["whole model"], figures["streaming"]
            print(
                f"| {family} {flavor}{' (resized)' if overrides else ''} | "
                f"{int(count) / 1e9:.2f}B | {largest:.2f} | {imports:.2f} | "
                f"{whole[0]:.2f}, {whole[1]:.0f} | {streamed[0]:.2f}, {streamed[1]:.0f} | "
                f"{streamed[0] - imports:.2f}, {(streamed[0] - imports) / largest:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
