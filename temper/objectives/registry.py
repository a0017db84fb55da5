"""Objectives by name: ``--objective.name`` picks a registered config section, whose
``build`` makes the objective.

A user module (the recipe's MODULE) adds its own objective by decorating its config section,
a dataclass subclass of ``temper.config.ObjectiveConfig`` beside its loss, with
``@register_objective``: its fields then get ``--objective.*`` flags and help like the
built-in ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from temper.config import (
    Config,
    ObjectiveConfig,
    objective_config_names,
    objective_config_type,
    register_objective_config,
)
from temper.data.batch import Batch
from temper.generation.engines import RolloutEngine
from temper.models.lora import adapters_disabled

register_objective = register_objective_config
"""``@register_objective`` on an ObjectiveConfig subclass makes it a choice of
``objective.name`` (its ``name`` default)."""

Metrics = dict[str, torch.Tensor]
"""An objective's step metrics: 0-d tensors that stay on the device until a log step."""


class Objective(Protocol):
    """What a training loop calls: a summed loss, its count, and metrics.

    The loop divides the sum by the count of the whole step (all ranks, all micro-batches),
    so any layout gives the gradients of one big batch.
    """

    def loss(
        self, model: nn.Module, batch: Batch
    ) -> tuple[torch.Tensor, torch.Tensor, Metrics]: ...

    def count(self, batch: Batch) -> torch.Tensor:
        """The units the loss sums over in ``batch`` (tokens; pairs for DPO)."""
        ...


@runtime_checkable
class RolloutObjective(Objective, Protocol):
    """An objective that makes its own training batch from prompts (RL): ``prepare`` samples a
    rollout and scores it; the loop trains ``updates_per_rollout`` steps on each."""

    updates_per_rollout: int

    def prepare(
        self,
        model: nn.Module,
        prompts: Batch,
        generator: torch.Generator,
        engine: RolloutEngine | None = None,
    ) -> tuple[Batch, dict[str, float]]:
        """Sample with ``engine`` (None: the model itself) and score: the training rows."""
        ...

    def sample(
        self, model: nn.Module, prompts: Batch, generator: torch.Generator, engine: RolloutEngine
    ) -> Any:
        """``prepare``'s sampling alone, touching no model unless the engine is the model:
        asynchronous rollouts run it on a thread while the model trains."""
        ...

    def score(
        self, model: nn.Module, prompts: Batch, sampled: Any
    ) -> tuple[Batch, dict[str, float]]:
        """``prepare``'s scoring of what ``sample`` returned."""
        ...

    def empty_rollout(self, model: nn.Module, prompts: int, width: int) -> Batch:
        """Zeros shaped like ``prepare``'s batch of ``model`` for ``prompts`` prompts, its rows
        ``width`` wide: what a checkpoint taken mid-rollout is loaded into."""
        ...


@runtime_checkable
class FinishesRollout(Protocol):
    """A rollout objective that finishes a step's rollout once all of it is drawn (GRPO's
    advantages over the reward std of the whole step): ``sum_over_data`` sums a tensor over
    the data-parallel ranks."""

    def finish_rollout(
        self, batches: list[Batch], sum_over_data: Callable[[torch.Tensor], torch.Tensor]
    ) -> None: ...


ReferenceMode = Callable[[nn.Module], contextlib.AbstractContextManager[None]]


def reference_policy(
    config: Config, build_reference: Callable[[], nn.Module]
) -> dict[str, nn.Module | ReferenceMode | None]:
    """The frozen reference as DPO and GRPO take it: with LoRA the base weights never change,
    so the policy with adapters off is the reference; otherwise a frozen copy."""
    lora = config.lora.enable
    return {
        "reference": None if lora else build_reference(),
        "reference_mode": adapters_disabled if lora else None,
    }


def build_objective(config: Config, build_reference: Callable[[], nn.Module]) -> Objective:
    """The objective ``objective.name`` names, built by its section."""
    section: ObjectiveConfig = config.objective
    objective_config_type(section.name)  # a clear error for an unregistered name
    return section.build(config, build_reference)


objective_names = objective_config_names
