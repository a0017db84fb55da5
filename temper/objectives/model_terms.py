"""Loss terms that a model brings to whichever objective trains it (the language-model loss,
DPO, GRPO): each objective calls them right after its policy forward, so a term is written
once and every objective adds it the same way."""

from __future__ import annotations

import torch
from torch import nn

from temper.models.protocols import IndexerTrainer
from temper.objectives.registry import Metrics


def indexer_term(model: nn.Module, units: torch.Tensor, metrics: Metrics) -> torch.Tensor:
    """``indexer_loss_weight * kl * units``: the sparse-attention indexers' KL term of the
    model's latest forward (DeepSeek V3.2, GLM-5) for a loss summed over ``units`` (the
    objective's count: tokens, pairs, completions), so that after the trainer's division by
    the global count the loss is the objective's plus ``weight * kl``. Logs ``indexer_kl`` in
    ``metrics``. 0 when the model has no indexers or they did not train in that forward.

    Call it before any other forward of the model: a no-grad one (a reference policy's)
    computes no KL and clears it."""
    kl = model.indexer_loss() if isinstance(model, IndexerTrainer) else None
    if kl is None:
        return torch.zeros((), device=units.device)
    metrics["indexer_kl"] = kl.detach()
    return model.args.indexer_loss_weight * kl * units
