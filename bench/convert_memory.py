"""Peak memory and time of `dcp-to-hf` (and `hf-to-dcp`): streaming against the whole model.

    python -m bench.convert_memory                          # llama3 1b and a 0.4B Qwen3-MoE
    python -m bench.convert_memory --cases moe --max-shard-gib 0.25
    python -m bench.convert_memory --cases moe --hf-to-dcp      # and back to a checkpoint

Each case writes a checkpoint of random bf16 weights once (built on meta, allocated in bf16,
filled, saved), then converts it to a bf16 HF folder twice, each in a fresh process: the
converter before streaming (`load_checkpoint_model`, which builds the whole fp32 model and
loads the checkpoint into it, then `save_hf`) and `dcp_to_hf`, which streams. A process's
peak is its resident set's high-water mark; "imports" is that of a process that only
imports the converter, the constant part of every figure. The streaming target: peak minus
imports at most twice the largest output file. With ``--hf-to-dcp`` the streamed HF folder
is converted back to an fp32 checkpoint the same two ways (`load_hf` and one DCP save, which
`hf-to-dcp` did before; `hf_to_dcp`, one file per tensor).
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
from temper.models import build_model, materialize
from torch.distributed.checkpoint.state_dict import get_model_state_dict
family, flavor, overrides, folder = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
model = build_model(family, flavor, overrides=overrides).to(torch.bfloat16)
count = sum(p.numel() for p in model.parameters())  # on meta: tied weights counted once
materialize(model, "cpu")  # allocated in bf16, tied weights tied again
torch.manual_seed(0)
with torch.no_grad():
    for p in model.parameters():
        p.normal_(std=0.02)
structure = run_structure(ep=1, lora=None, param_dtype=torch.bfloat16)
write_checkpoint(__import__("pathlib").Path(folder), {"model": get_model_state_dict(model)},
                 build_metadata(model, step=1, structure=structure))
print(count)
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
"""dcp-to-hf: the converter before streaming (what its dcp_to_hf did with the weights), and
dcp_to_hf itself."""

CONVERT_BACK = {
    "whole model": (
        "import sys, torch\nfrom pathlib import Path\n"
        "from torch.distributed.checkpoint.state_dict import get_model_state_dict\n"
        "from temper.checkpoint.manager import write_checkpoint\n"
        "from temper.checkpoint.metadata import build_metadata, run_structure\n"
        "from temper.models import load_hf\n"
        "model = load_hf(Path(sys.argv[1]))\n"
        "structure = run_structure(ep=1, lora=None, param_dtype=torch.float32)\n"
        "write_checkpoint(Path(sys.argv[2]), {'model': get_model_state_dict(model)}, "
        "build_metadata(model, step=0, structure=structure))"
    ),
    "streaming": (
        "import sys\nfrom pathlib import Path\n"
        "from temper.checkpoint.convert import hf_to_dcp\n"
        "hf_to_dcp(Path(sys.argv[1]), Path(sys.argv[2]))"
    ),
}
"""hf-to-dcp (an HF folder to an fp32 checkpoint): the converter before streaming, which
loaded the whole model, and hf_to_dcp itself."""


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
    parser.add_argument(
        "--hf-to-dcp",
        action="store_true",
        help="also convert the HF folder back to an fp32 checkpoint, both ways",
    )
    args = parser.parse_args()
    shard_bytes = str(int(args.max_shard_gib * 2**30))
    print(
        f"bf16 checkpoint -> bf16 HF folder, shards of at most {args.max_shard_gib} GiB, "
        f"torch {torch.__version__}\n"
    )
    print(
        "| direction | model | parameters | largest output file (GiB) | imports (GiB) | whole "
        "model: peak (GiB), time (s) | streaming: peak (GiB), time (s) | streaming peak - "
        "imports, / largest file |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
    imports, _, _ = measure(CONVERT["imports"])
    for case in args.cases.split(","):
        family, flavor, overrides = CASES[case]
        label = f"{family} {flavor}{' (resized)' if overrides else ''}"
        with tempfile.TemporaryDirectory(dir=args.work) as work:
            folder = Path(work) / "step-1"
            _, _, count = measure(WRITE, family, flavor, json.dumps(overrides), str(folder))
            directions = [("dcp-to-hf", CONVERT, folder, "*.safetensors", [shard_bytes])]
            if args.hf_to_dcp:
                hf = Path(work) / "dcp-to-hf-streaming"
                directions.append(("hf-to-dcp", CONVERT_BACK, hf, "*.distcp", []))
            for direction, codes, source, pattern, extra in directions:
                figures = {}
                for name, code in codes.items():
                    output = Path(work) / f"{direction}-{name.replace(' ', '_')}"
                    figures[name] = measure(code, str(source), str(output), *extra)[:2]
                largest = max(p.stat().st_size for p in output.glob(pattern)) / 2**30
                whole, streamed = figures["whole model"], figures["streaming"]
                print(
                    f"| {direction} | {label} | {int(count) / 1e9:.2f}B | {largest:.2f} | "
                    f"{imports:.2f} | {whole[0]:.2f}, {whole[1]:.0f} | {streamed[0]:.2f}, "
                    f"{streamed[1]:.0f} | {streamed[0] - imports:.2f}, "
                    f"{(streamed[0] - imports) / largest:.2f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
