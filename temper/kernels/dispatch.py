"""Which implementation each fused op runs: the config switch, the device, and one fallback rule.

Every op has a plain-PyTorch ``reference`` (what tests compare against), a ``compile`` form
(``torch.compile`` of that reference: Inductor fuses the pointwise chain and recomputes it in
backward, so it also saves fewer activations) and a ``triton`` form with hand-written forward
and backward kernels (CUDA only). ``auto`` picks triton on CUDA when Triton is installed and the
reference anywhere else. On CPU ``compile`` is faster per step (docs/kernels.md) but costs
seconds of compilation per op and shape in every new process, which dominates short runs and
tests, so it is asked for by name. A choice that cannot run on the device falls back to the
reference with a one-line notice.

There is no process-wide choice: each call names its own (``impl``; None is the reference).
An Engine resolves its run's ``Kernels`` for its device once (``resolve_kernels``, where the
notices print) and hands them to its model (``use_kernels``), whose forward context carries
them to the layers; an objective carries its run's ``Kernels`` for the loss. A model or loss
nobody configured runs every reference, so two runs in one process never see each other's.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import shutil
import sys
from collections.abc import Callable
from typing import ParamSpec, TypeVar, get_args

import torch

from temper.config.config import Impl, Kernels, Op

OPS: tuple[Op, ...] = get_args(Op)
P = ParamSpec("P")
R = TypeVar("R")


REFERENCE = Kernels(
    fused_cross_entropy=False, fused_ring_attention=False, **dict.fromkeys(OPS, "reference")
)
"""Every op's plain-PyTorch reference and full logits: what an unconfigured model runs."""


def resolve_kernels(kernels: Kernels, device: torch.device) -> Kernels:
    """``kernels`` with each op's choice replaced by what runs on ``device``: ``auto`` picked,
    an unavailable choice the reference (a one-line notice each). An Engine calls it once at
    start-up, so notices print then rather than mid-step."""
    ops = {op: _resolve(op, getattr(kernels, op), device) for op in OPS}
    return dataclasses.replace(kernels, **ops)


def implementation(op: Op, device: torch.device, impl: Impl | None) -> Impl:
    """The concrete implementation of ``op`` for tensors on ``device`` when ``impl`` is asked
    for (None: the reference). A choice not resolved beforehand is resolved here, its notice
    printed once per process.

    Inside a compiled region the reference runs: the surrounding compile fuses it anyway, and
    a nested compiled or Triton call would only break its graph.
    """
    if impl is None or torch.compiler.is_compiling():
        return "reference"
    return _resolve_once(op, impl, device.type)


@functools.cache
def _resolve_once(op: Op, choice: Impl, device_type: str) -> Impl:
    return _resolve(op, choice, torch.device(device_type))


def _resolve(op: Op, choice: Impl, device: torch.device) -> Impl:
    if choice == "auto":
        if device.type == "cuda" and unavailable("triton", device) is None:
            return "triton"
        return "reference"
    reason = unavailable(choice, device)
    if reason is None:
        return choice
    print(f"temper: kernels.{op}={choice} cannot run ({reason}); using reference", file=sys.stderr)
    return "reference"


def unavailable(impl: Impl, device: torch.device) -> str | None:
    """Why ``impl`` cannot run on ``device``, or None when it can."""
    if impl == "triton":
        if device.type != "cuda":
            return f"Triton kernels run on CUDA, this is {device.type}"
        if not triton_installed():
            return "Triton is not installed"
    if impl == "compile":
        if device.type == "cpu" and not _cpp_compiler():
            return "torch.compile on CPU needs a C++ compiler (g++ or clang++)"
        if device.type == "cuda" and not triton_installed():
            return "torch.compile on CUDA needs Triton"
    return None


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _cpp_compiler() -> str | None:
    return next(filter(None, map(shutil.which, (os.environ.get("CXX", "g++"), "clang++"))), None)


def choose(
    op: Op,
    device: torch.device,
    impl: Impl | None,
    reference: Callable[P, R],
    triton: Callable[[], Callable[P, R]],
) -> Callable[P, R]:
    """The function that runs ``op`` when ``impl`` is asked for (None: the reference), as
    ``implementation`` resolves it. ``triton`` loads the Triton form on demand, so Triton is
    imported only when used."""
    impl = implementation(op, device, impl)
    if impl == "compile":
        return compiled(reference)
    if impl == "triton":
        return triton()
    return reference


@functools.cache
def compiled(fn: Callable[P, R]) -> Callable[P, R]:
    """One compiled wrapper per reference function, shared by every caller."""
    return torch.compile(fn)
