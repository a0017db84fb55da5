"""Which implementation each fused op runs: the config switch, the device, and one fallback rule.

Every op has a plain-PyTorch ``reference`` (what tests compare against), a ``compile`` form
(``torch.compile`` of that reference: Inductor fuses the pointwise chain and recomputes it in
backward, so it also saves fewer activations) and a ``triton`` form with hand-written forward
and backward kernels (CUDA only). ``auto`` picks triton on CUDA when Triton is installed and the
reference anywhere else. On CPU ``compile`` is faster per step (docs/kernels.md) but costs
seconds of compilation per op and shape in every new process, which dominates short runs and
tests, so it is asked for by name. A choice
that cannot run on the device falls back to the reference with a one-line notice.

Until ``configure_kernels`` is called, every op runs its reference and the loss uses full
logits: a library user or a test gets the plain math; a training run configures ``Kernels``.
The loss does not depend on that process-wide choice when given its own: an objective built
from a run's config carries that run's ``Kernels`` (``implementation(op, device, kernels)``),
so two runs in one process may differ there.
"""

from __future__ import annotations

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


REFERENCE = Kernels(fused_cross_entropy=False, **dict.fromkeys(OPS, "reference"))
"""Every op's plain-PyTorch reference and full logits: the state before configure_kernels."""

_settings = REFERENCE
_resolved: dict[tuple[Op, Impl, str], Impl] = {}
"""(op, choice, device type) -> what runs, so a fallback notice prints once per
configuration."""


def configure_kernels(kernels: Kernels, device: torch.device) -> None:
    """Make ``kernels`` the process-wide choice and resolve it for ``device`` now, so any
    fallback notice prints once at start-up rather than mid-step."""
    global _settings
    _settings = kernels
    _resolved.clear()
    for op in OPS:
        implementation(op, device)


def kernel_settings() -> Kernels:
    """The process-wide choices (``REFERENCE`` until ``configure_kernels``)."""
    return _settings


def implementation(op: Op, device: torch.device, kernels: Kernels | None = None) -> Impl:
    """The concrete implementation of ``op`` for tensors on ``device`` under ``kernels``
    (None: the process-wide choices).

    Inside a compiled region the reference runs: the surrounding compile fuses it anyway, and
    a nested compiled or Triton call would only break its graph.
    """
    if torch.compiler.is_compiling():
        return "reference"
    choice: Impl = getattr(kernels or _settings, op)
    key = (op, choice, device.type)
    if key not in _resolved:
        _resolved[key] = _resolve(op, choice, device)
    return _resolved[key]


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
    """The function that runs ``op``: ``impl`` when given (tests pin one), else the resolved
    choice. ``triton`` loads the Triton form on demand, so Triton is imported only when used."""
    if impl in (None, "auto"):
        impl = implementation(op, device)
    if impl == "compile":
        return compiled(reference)
    if impl == "triton":
        return triton()
    return reference


@functools.cache
def compiled(fn: Callable[P, R]) -> Callable[P, R]:
    """One compiled wrapper per reference function, shared by every caller."""
    return torch.compile(fn)
