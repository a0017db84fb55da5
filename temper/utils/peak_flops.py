"""Peak FLOP/s of the device, the denominator of MFU.

GPUs come from a table of dense (no sparsity) datasheet peaks. A CPU has no useful
datasheet number, so a short matmul probe measures it once per machine, thread
count, dtype and torch version, and the result is cached on disk.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

# Substring of torch.cuda.get_device_name() -> (bf16, fp32) dense peak FLOP/s.
# More specific names come first: the first match wins.
GPU_PEAKS: list[tuple[str, float, float]] = [
    ("GB200", 2.5e15, 80e12),
    ("B200", 2.25e15, 80e12),
    ("H200", 989e12, 67e12),
    ("GH200", 989e12, 67e12),
    ("H100 NVL", 835e12, 60e12),
    ("H100 PCIe", 756e12, 51e12),
    ("H100", 989e12, 67e12),
    ("H800", 989e12, 67e12),
    ("A100", 312e12, 19.5e12),
    ("A800", 312e12, 19.5e12),
    ("L40S", 362e12, 91.6e12),
    ("L40", 181e12, 90.5e12),
    ("L4", 121e12, 30.3e12),
    ("A10G", 70e12, 31.2e12),
    ("A10", 125e12, 31.2e12),
    ("MI300X", 1307e12, 163e12),
    ("MI250X", 383e12, 47.9e12),
    ("RTX 4090", 165e12, 82.6e12),
    ("RTX 3090", 71e12, 35.6e12),
]


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s for `dtype` matmuls on `device`; None for an unknown GPU."""
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), dtype)
    return cpu_peak_flops(dtype)


def gpu_peak_flops(name: str, dtype: torch.dtype) -> float | None:
    for key, bf16, fp32 in GPU_PEAKS:
        if key in name:
            return fp32 if dtype == torch.float32 else bf16
    return None


def cpu_peak_flops(dtype: torch.dtype, cache_file: Path | None = None) -> float:
    """Best observed matmul FLOP/s on this CPU, measured once and cached."""
    cache_file = cache_file or _cache_dir() / "cpu_peak_flops.json"
    key = f"{platform.processor() or platform.machine()}|{_cpu_name()}|"
    key += f"threads={torch.get_num_threads()}|{dtype}|torch={torch.__version__}"
    cache = _read_json(cache_file)
    if key not in cache:
        cache[key] = _measure_matmul_flops(dtype)
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(cache_file)
    return float(cache[key])


def _measure_matmul_flops(dtype: torch.dtype, n: int = 1024, repeats: int = 8) -> float:
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)  # warm up the BLAS thread pool
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.platform()


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "temper"


def _read_json(path: Path) -> dict[str, float]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
