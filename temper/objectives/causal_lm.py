"""Next-token cross-entropy: the objective of pretraining and SFT."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from temper.kernels.attention import DocumentMask

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
    """Sum of next-token negative log-likelihoods over labels that are not ignored.

    A model with ``aux_loss()`` (MoE load balancing) adds ``router_aux_loss_coef * aux`` per
    valid token, so after the trainer's division the gradient carries coef x the token-weighted
    mean of aux over micro-batches and ranks, and one batch's loss equals HF's CE + coef * aux.
    """

    def loss(
        self, model: nn.Module, batch: Batch
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        logits = model(batch["input_ids"], batch.get("position_ids"), documents(batch))
        labels = batch["labels"]
        loss_sum = F.cross_entropy(
            logits.flatten(0, 1).float(),
            labels.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        n_tokens = count_tokens(batch)
        metrics: dict[str, float] = {}
        if hasattr(model, "aux_loss"):
            aux = model.aux_loss()
            loss_sum = loss_sum + model.args.router_aux_loss_coef * aux * n_tokens
            metrics["aux_loss"] = aux.item()
            metrics["moe_load_imbalance"] = model.load_imbalance().item()
        return loss_sum, n_tokens, metrics


def documents(batch: Batch) -> DocumentMask | None:
    """The packed documents of a batch with ``position_ids`` (they restart at each one), so
    attention never crosses a document boundary; None for a continuous stream."""
    position_ids = batch.get("position_ids")
    return None if position_ids is None else DocumentMask.from_position_ids(position_ids)


def count_tokens(batch: Batch) -> torch.Tensor:
    """Positions that carry a label: the denominator of the token-mean loss."""
    return (batch["labels"] != IGNORE_INDEX).sum()
