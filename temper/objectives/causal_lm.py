"""Next-token cross-entropy: the objective of pretraining and SFT."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
"""Label value of a position that does not count in the loss."""

Batch = dict[str, torch.Tensor]


class Objective(Protocol):
    """What the trainer loop calls: a summed loss, its token count, extra metrics.

    The trainer divides the sum by the valid-token count of the whole step (all ranks,
    all micro-batches), so any layout gives the gradients of one big batch.
    """

    def loss(
        self, model: nn.Module, batch: Batch
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]: ...


class CausalLM:
    """Sum of next-token negative log-likelihoods over labels that are not ignored."""

    def loss(
        self, model: nn.Module, batch: Batch
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        logits = model(batch["input_ids"], batch.get("position_ids"))
        labels = batch["labels"]
        loss_sum = F.cross_entropy(
            logits.flatten(0, 1).float(),
            labels.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        return loss_sum, count_tokens(batch), {}


def count_tokens(batch: Batch) -> torch.Tensor:
    """Positions that carry a label: the denominator of the token-mean loss."""
    return (batch["labels"] != IGNORE_INDEX).sum()
