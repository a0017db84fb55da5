"""Direct Preference Optimization (Rafailov et al., 2023) and IPO (Azar et al., 2023).

Per pair, with summed answer log-probabilities under the policy (``pi``) and the frozen
reference (``ref``), ``h = (pi_c - ref_c) - (pi_r - ref_r)``:

- sigmoid: ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)`` (``eps`` = label
  smoothing: the chance that a label is flipped, Mitchell's conservative DPO);
- ipo: ``(h - 1 / (2 beta))^2``.

The loss is per pair, so ``count`` is the number of pairs and the trainer's division makes
it the mean over the step's pairs. The implicit rewards ``beta (pi - ref)`` give the
metrics: chosen and rejected rewards, their margin, and how often chosen wins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.distributed.nn as dist_nn
import torch.nn.functional as F
from torch import nn

from temper.config import Config, ObjectiveConfig, check_positive, check_range
from temper.data.batch import SEQUENCE_SHARD, Batch, SequenceShard
from temper.objectives.causal_lm import label_log_probs
from temper.objectives.registry import (
    Metrics,
    Objective,
    ReferenceMode,
    reference_policy,
    register_objective,
)

LossType = Literal["sigmoid", "ipo"]


@register_objective
@dataclass
class DPOConfig(ObjectiveConfig):
    """``--objective.*`` of DPO / IPO on preference pairs."""

    name: str = "dpo"
    """Training objective, as registered with `temper.objectives.register_objective`."""
    beta: float = 0.1
    """Strength of the pull toward the reference (the KL coefficient)."""
    label_smoothing: float = 0.0
    """Sigmoid loss: assumed probability that a preference label is flipped."""
    loss_type: LossType = "sigmoid"
    """sigmoid (DPO) or ipo."""

    data_formats: ClassVar[tuple[str, ...]] = ("preference",)

    def validate(self, config: Config) -> None:
        check_positive(config, "objective.beta")
        check_range(config, "objective.label_smoothing", 0.0, 0.5)

    def build(self, config: Config, build_reference: Callable[[], nn.Module]) -> Objective:
        return DPO(
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            loss_type=self.loss_type,
            **reference_policy(config, build_reference),
        )


def sequence_log_probs(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    shard: SequenceShard | None = None,
) -> torch.Tensor:
    """Sum over each row of the log-probabilities of its labels (ignored ones count 0). With
    a sequence-parallel ``shard`` the slices' sums are added over the SP group (its backward
    sums each rank's gradient), so every SP rank holds the whole rows' sums."""
    sums = label_log_probs(model, input_ids, labels, position_ids, shard=shard).sum(dim=-1)
    if shard is not None and shard.group is not None:
        sums = dist_nn.all_reduce(sums, group=shard.group)
    return sums


def preference_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    loss_type: LossType = "sigmoid",
) -> torch.Tensor:
    """Per-pair losses from per-sequence summed log-probabilities (see the module docstring)."""
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    if loss_type == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(
        -beta * h
    )


class DPO:
    """DPO/IPO against a reference: a frozen model, or the policy inside ``reference_mode``
    (the base with LoRA adapters off) when ``reference`` is None."""

    def __init__(
        self,
        *,
        beta: float,
        label_smoothing: float = 0.0,
        loss_type: LossType = "sigmoid",
        reference: nn.Module | None = None,
        reference_mode: ReferenceMode | None = None,
    ) -> None:
        if (reference is None) == (reference_mode is None):
            raise ValueError("DPO needs exactly one of a reference model or a reference mode")
        self.beta = beta
        self.label_smoothing = label_smoothing
        self.loss_type = loss_type
        self.reference = reference
        self.reference_mode = reference_mode

    def count(self, batch: Batch) -> torch.Tensor:
        """Pairs: the unit the loss is averaged over."""
        return torch.tensor(batch["chosen_input_ids"].shape[0])

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
        input_ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
        labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
        n = batch["chosen_input_ids"].shape[0]
        # Under SP: both sides are sliced alike (rows of one width), positions are global.
        shard = batch.get(f"chosen_{SEQUENCE_SHARD}")
        positions = None
        if "chosen_position_ids" in batch:
            positions = torch.cat([batch["chosen_position_ids"], batch["rejected_position_ids"]])
        rows = (input_ids, labels, positions, shard)
        policy = sequence_log_probs(model, *rows)
        with torch.no_grad():
            if self.reference is not None:
                ref = sequence_log_probs(self.reference, *rows)
            else:
                with self.reference_mode(model):
                    ref = sequence_log_probs(model, *rows)
        losses = preference_loss(
            policy[:n],
            policy[n:],
            ref[:n],
            ref[n:],
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            loss_type=self.loss_type,
        )
        chosen = self.beta * (policy[:n] - ref[:n]).detach()
        rejected = self.beta * (policy[n:] - ref[n:]).detach()
        metrics = {
            "rewards_chosen": chosen.mean(),
            "rewards_rejected": rejected.mean(),
            "reward_margin": (chosen - rejected).mean(),
            "reward_accuracy": (chosen > rejected).float().mean(),
        }
        return losses.sum(), self.count(batch), metrics
