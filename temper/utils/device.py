"""Device, backend and process-group choice, made once for the whole run."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Runtime:
    """Where this process runs: its device and its place in the world."""

    device: torch.device
    rank: int
    local_rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_runtime() -> Runtime:
    """Pick CUDA (nccl) when present, else CPU (gloo); join the torchrun group if any."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, device_id=device if backend == "nccl" else None)
    return Runtime(device=device, rank=rank, local_rank=local_rank, world_size=world_size)


def shutdown_runtime() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is float32 on CPU and bfloat16 on CUDA."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed every RNG the run touches; optionally forbid nondeterministic kernels."""
    random.seed(seed)
    torch.manual_seed(seed)
    # Set either way: a process that ran a deterministic run before runs this one as asked.
    torch.use_deterministic_algorithms(deterministic)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
