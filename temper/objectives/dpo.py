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

import contextlib
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from temper.objectives.causal_lm import Batch, label_log_probs

LossType = Literal["sigmoid", "ipo"]


def sequence_log_probs(
    model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Sum over each row of the log-probabilities of its labels (ignored ones count 0)."""
    return label_log_probs(model, input_ids, labels).sum(dim=-1)


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
        reference_mode: Callable[[nn.Module], contextlib.AbstractContextManager[None]]
        | None = None,
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

    def loss(
        self, model: nn.Module, batch: Batch
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        input_ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
        labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
        n = batch["chosen_input_ids"].shape[0]
        policy = sequence_log_probs(model, input_ids, labels)
        with torch.no_grad():
            if self.reference is not None:
                ref = sequence_log_probs(self.reference, input_ids, labels)
            else:
                with self.reference_mode(model):
                    ref = sequence_log_probs(model, input_ids, labels)
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
            "rewards_chosen": chosen.mean().item(),
            "rewards_rejected": rejected.mean().item(),
            "reward_margin": (chosen - rejected).mean().item(),
            "reward_accuracy": (chosen > rejected).float().mean().item(),
        }
        return losses.sum(), self.count(batch), metrics
