"""Weights to a folder of safetensors files, streamed: the tensors arrive one at a time (as
``Engine.hf_state_dict`` gathers them) and leave in files of about ``bucket_bytes`` each, so
at most one bucket is held in memory besides the model, never a whole copy of it. In
``/dev/shm`` the files are memory a server reads without a disk."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

DEFAULT_BUCKET_BYTES = 512 * 2**20


def write_weights(
    folder: Path, weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> int:
    """Replace the safetensors files of ``folder`` with ``weights`` in buckets of about
    ``bucket_bytes``; the bytes written. Each tensor is copied (to CPU): tied ones must not
    share storage in a file."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.safetensors"):
        old.unlink()
    bucket: dict[str, torch.Tensor] = {}
    size = total = files = 0
    for name, tensor in weights:
        bucket[name] = tensor.detach().to("cpu", copy=True).contiguous()
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            files += 1
            save_file(bucket, str(folder / f"weights-{files:05d}.safetensors"))
            bucket, total, size = {}, total + size, 0
    if bucket:
        files += 1
        save_file(bucket, str(folder / f"weights-{files:05d}.safetensors"))
    return total + size
