"""What some model families offer beyond the decoder, declared so loops and losses can ask
with ``isinstance`` instead of probing for attributes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from temper.models.layers.moe import RoutingStats
    from temper.models.layers.mtp import MTPLoss


class RoutedArgs(Protocol):
    router_aux_loss_coef: float
    """Weight of the load-balancing loss per valid token (0 for aux-loss-free balancing)."""


@runtime_checkable
class RoutedModel(Protocol):
    """A mixture-of-experts model whose latest forward's routing (``routing``: its MoE layers'
    statistics, collected from their outputs) gives a load-balancing loss (unscaled) and the
    load imbalance (max over mean expert load)."""

    args: RoutedArgs

    def routing(self) -> list[RoutingStats]: ...

    def aux_loss(self) -> torch.Tensor: ...

    def load_imbalance(self) -> torch.Tensor: ...


@runtime_checkable
class PostStepHook(Protocol):
    """A model that updates non-gradient state after each optimizer step (DeepSeek V3's
    expert-bias balancing); every rank calls it at the same point."""

    def after_optimizer_step(self) -> None: ...


@runtime_checkable
class MultiTokenPredictor(Protocol):
    """A model with multi-token-prediction depths (DeepSeek V3): after a training forward,
    ``mtp_loss`` gives their weighted draft loss and metrics (None without depths), through
    the head in chunks of ``chunk_tokens``."""

    def mtp_loss(
        self, labels: torch.Tensor, position_ids: torch.Tensor | None, chunk_tokens: int
    ) -> MTPLoss | None: ...


class IndexerArgs(Protocol):
    indexer_loss_weight: float
    """Weight of the indexer's KL term per valid token."""


@runtime_checkable
class IndexerTrainer(Protocol):
    """A model with DeepSeek sparse attention (DeepSeek V3.2, GLM-5): after a training
    forward, ``indexer_loss`` gives its indexers' KL term per token (unweighted; None when
    the indexers do not train)."""

    args: IndexerArgs

    def indexer_loss(self) -> torch.Tensor | None: ...


@runtime_checkable
class VisionModel(Protocol):
    """A model that reads images (Qwen3.5's vision-language families): ``embed`` puts the
    vision tower's features in place of the image tokens' embeddings, from ``pixel_values``
    and ``image_grid_thw`` as transformers' processor gives them."""

    visual: nn.Module

    def embed(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
    ) -> torch.Tensor: ...
