"""The loop's own state, checkpointed beside the engine's: where training is and what data
comes next."""

from __future__ import annotations

from typing import Any

import torch

from temper.data.batch import Batch
from temper.data.loader import BatchLoader
from temper.data.stream import merge_states
from temper.parallel.collectives import all_gather_objects


class TrainState:
    """Step, tokens seen and the loader's position: a ``Stateful`` that ``Engine.save``
    writes and ``Engine.load`` restores.

    Each data rank holds its own lanes of the stream; saving gathers them all, so the saved
    position resumes at any data-parallel size (``temper.data.stream``).

    ``rollout`` (the micro-batches of the current RL rollout and their metrics) is kept for
    the steps that train on it; it is not checkpointed, so a resume between two updates of
    one rollout samples a new rollout.
    """

    def __init__(self, loader: BatchLoader) -> None:
        self.loader = loader
        self.step = 0
        self.tokens_seen = 0
        self.rollout: tuple[list[Batch], dict[str, torch.Tensor]] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "dataloader": merge_states(all_gather_objects(self.loader.state_dict())),
            "train_state": {"step": self.step, "tokens_seen": self.tokens_seen},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["dataloader"])
        self.step = state["train_state"]["step"]
        self.tokens_seen = state["train_state"]["tokens_seen"]
