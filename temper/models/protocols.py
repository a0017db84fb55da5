"""What some model families offer beyond the decoder, declared so loops and losses can ask
with ``isinstance`` instead of probing for attributes."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


class RoutedArgs(Protocol):
    router_aux_loss_coef: float
    """Weight of the load-balancing loss per valid token (0 for aux-loss-free balancing)."""


@runtime_checkable
class RoutedModel(Protocol):
    """A mixture-of-experts model whose latest forward's routing gives a load-balancing loss
    (unscaled) and the load imbalance (max over mean expert load)."""

    args: RoutedArgs

    def aux_loss(self) -> torch.Tensor: ...

    def load_imbalance(self) -> torch.Tensor: ...


@runtime_checkable
class PostStepHook(Protocol):
    """A model that updates non-gradient state after each optimizer step (DeepSeek V3's
    expert-bias balancing); every rank calls it at the same point."""

    def after_optimizer_step(self) -> None: ...
