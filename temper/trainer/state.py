"""The loop's own state, checkpointed beside the engine's: where training is, what data
comes next, and the RL rollout still being trained on."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from temper.data.batch import Batch
from temper.data.loader import BatchLoader
from temper.data.stream import merge_states
from temper.parallel.collectives import all_gather_objects
from temper.trainer.console import RunCounts
from temper.trainer.rollout_buffer import Rollout, restore_rollout, rollout_state


class TrainState:
    """Step, tokens seen, the run's counts (``RunCounts``' totals over the data ranks), the
    loader's position and the current rollout: a ``StepShaped`` Stateful that ``Engine.save``
    writes and ``Engine.load`` restores.

    Each data rank holds its own lanes of the stream; saving gathers them all, so the saved
    position resumes at any data-parallel size (``temper.data.stream``).

    ``rollout`` (the micro-batches of the current RL rollout and their metrics) is kept for
    the ``updates_per_rollout`` steps that train on it. A checkpoint taken between two of
    them holds it (``temper.trainer.rollout_buffer``), so the resumed run trains on the same
    rollout. What a checkpoint is loaded into is ``load_skeleton(step)`` of the step saved,
    built from ``rollout_template`` (zeros shaped like one rollout's micro-batches at full
    width), not from this state's own step: a fresh state loads any checkpoint.
    ``skipped`` lists the steps skipped for a non-finite loss or gradient norm
    (``training.skip_nonfinite``); a resumed run keeps counting them.
    """

    def __init__(
        self,
        loader: BatchLoader,
        counts: RunCounts,
        sum_counts: Callable[[Mapping[str, int]], dict[str, int]],
        *,
        updates_per_rollout: int = 1,
        rollout_template: Callable[[], list[Batch]] | None = None,
        rollout_width: int = 0,
    ) -> None:
        self.loader = loader
        self.counts = counts
        self.sum_counts = sum_counts
        self.step = 0
        self.tokens_seen = 0
        self.skipped: list[int] = []
        self.rollout: Rollout | None = None
        self.updates_per_rollout = updates_per_rollout
        self.rollout_template = rollout_template
        self.rollout_width = rollout_width

    def mid_rollout(self, step: int) -> bool:
        """Step ``step`` is followed by another update on the same rollout (so a checkpoint of
        it holds the rollout)."""
        return self.rollout_template is not None and step % self.updates_per_rollout != 0

    def state_dict(self) -> dict[str, Any]:
        state = self._position()
        if self.mid_rollout(self.step):
            state["rollout"] = rollout_state(*self.rollout, self.rollout_width)
        return state

    def load_skeleton(self, step: int) -> dict[str, Any]:
        """What a checkpoint of ``step`` is loaded into: its saved tensors' shapes (the
        rollout's zeros when that step held one), whatever this state's own step is."""
        skeleton = self._position()
        if self.mid_rollout(step):
            skeleton["rollout"] = rollout_state(self.rollout_template(), None, self.rollout_width)
        return skeleton

    def _position(self) -> dict[str, Any]:
        """Where the run is: the data position (every data rank's lanes) and the counters."""
        return {
            "dataloader": merge_states(all_gather_objects(self.loader.state_dict())),
            "train_state": {
                "step": self.step,
                "tokens_seen": self.tokens_seen,
                "skipped": self.skipped,
                "run_counts": self.counts.totals(self.sum_counts(self.counts.local)),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["dataloader"])
        self.step = state["train_state"]["step"]
        self.tokens_seen = state["train_state"]["tokens_seen"]
        self.skipped = list(state["train_state"].get("skipped", []))
        self.counts.carried = dict(state["train_state"].get("run_counts", {}))
        if "rollout" in state:
            self.rollout = restore_rollout(state["rollout"])
