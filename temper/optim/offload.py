"""Optimizer state to CPU and back, so a rollout can use the device memory it held.

AdamW's moments are twice the size of the trainable parameters; while the policy samples,
nothing reads them. ``offload`` copies every state tensor to CPU memory and drops the device
copy; ``restore`` brings them back. (A CPU run copies too: no memory is gained there, but the
path is the one a GPU run takes, and the tests exercise it.) The state dicts keep
their keys, and the parameters (and the LR scheduler's param groups) are untouched, so the
next step is the step that would have run. A sharded (DTensor) state moves its local shard
and is rebuilt with the same mesh and placements.

While offloaded the optimizer refuses to step or to give its state dict (a checkpoint), with
an error that says why; both hooks sit on the optimizer, so every caller is covered.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch.distributed.tensor import DTensor


class OptimizerOffloadedError(RuntimeError):
    """The optimizer was used while its state lived on the CPU."""


@runtime_checkable
class OffloadAware(Protocol):
    """An optimizer that keeps statistics of the forwards between its steps (QK-clip) and
    must ignore those of an offloaded spell: rollouts are no training step's."""

    def set_offloaded(self, offloaded: bool) -> None: ...


class OptimizerOffload:
    """Moves one optimizer's state between its device and the CPU; both calls idempotent."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.offloaded = False
        self._homes: dict[tuple[torch.Tensor, str], tuple[Any, ...]] = {}
        optimizer.register_step_pre_hook(self._refuse("step"))
        optimizer.register_state_dict_pre_hook(self._refuse("save its state"))

    def offload(self) -> None:
        if self.offloaded:
            return
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    self._homes[param, key] = _home(value)
                    local = value.to_local() if isinstance(value, DTensor) else value
                    state[key] = local.to("cpu", copy=True)
        self.offloaded = True
        if isinstance(self.optimizer, OffloadAware):
            self.optimizer.set_offloaded(True)

    def restore(self) -> None:
        if not self.offloaded:
            return
        for param, state in self.optimizer.state.items():
            for key in state:
                if (param, key) in self._homes:
                    state[key] = _rebuild(state[key], self._homes.pop((param, key)))
        self.offloaded = False
        if isinstance(self.optimizer, OffloadAware):
            self.optimizer.set_offloaded(False)

    def check(self, action: str) -> None:
        """Raise if offloaded: ``action`` needs the optimizer state in place."""
        if self.offloaded:
            raise OptimizerOffloadedError(
                f"cannot {action}: the optimizer state is offloaded to CPU; call "
                "restore_optimizer() first"
            )

    def _refuse(self, action: str) -> Any:
        return lambda *_: self.check(action)


def _home(value: torch.Tensor) -> tuple[Any, ...]:
    """What rebuilds ``value`` from a CPU copy of its (local) data."""
    if isinstance(value, DTensor):
        return (value.device, value.device_mesh, value.placements, value.shape, value.stride())
    return (value.device,)


def _rebuild(cpu: torch.Tensor, home: tuple[Any, ...]) -> torch.Tensor:
    local = cpu.to(home[0])
    if len(home) == 1:
        return local
    _, mesh, placements, shape, stride = home
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
