"""The loop's own state, checkpointed beside the engine's: where training is and what data
comes next."""

from __future__ import annotations

from typing import Any

import torch

from temper.data.batch import Batch
from temper.data.loader import BatchLoader


class TrainState:
    """Step, tokens seen and the loader's position: a ``Stateful`` that ``Engine.save``
    writes and ``Engine.load`` restores.

    ``rollout`` (the micro-batches of the current RL rollout and their metrics) is kept for
    the steps that train on it; it is not checkpointed, so a resume between two updates of
    one rollout samples a new rollout. ``skipped`` lists the steps skipped for a non-finite
    loss or gradient norm (``training.skip_nonfinite``); a resumed run keeps counting them.
    """

    def __init__(self, loader: BatchLoader) -> None:
        self.loader = loader
        self.step = 0
        self.tokens_seen = 0
        self.skipped: list[int] = []
        self.rollout: tuple[list[Batch], dict[str, torch.Tensor]] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "dataloader": self.loader.state_dict(),
            "train_state": {
                "step": self.step,
                "tokens_seen": self.tokens_seen,
                "skipped": self.skipped,
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["dataloader"])
        self.step = state["train_state"]["step"]
        self.tokens_seen = state["train_state"]["tokens_seen"]
        self.skipped = list(state["train_state"].get("skipped", []))
