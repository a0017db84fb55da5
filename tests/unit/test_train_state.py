"""The Trainer's state through a checkpoint: what a load fills is shaped by the step saved
(``TrainState.load_skeleton``), not by the step the state holds, so a fresh state loads a
checkpoint taken between two updates of one rollout."""

from __future__ import annotations

from pathlib import Path

import torch

from temper.config import Checkpoint, Config, Job, Metrics, Training
from temper.data.batch import Batch
from temper.data.loader import build_loader
from temper.engine import Engine
from temper.trainer.console import RunCounts
from temper.trainer.state import TrainState
from temper.utils.device import Runtime

CPU = Runtime(device=torch.device("cpu"), rank=0, local_rank=0, world_size=1)
WIDTH = 16


def _template() -> list[Batch]:
    """Zeros shaped like one rollout micro-batch at full width (what the Trainer builds)."""
    return [{"input_ids": torch.zeros(2, WIDTH, dtype=torch.long), "advantages": torch.zeros(2)}]


def _state(config: Config, engine: Engine) -> TrainState:
    return TrainState(
        build_loader(config, engine.tokenizer, 0, 1),
        RunCounts(),
        dict,
        updates_per_rollout=2,
        rollout_template=_template,
        rollout_width=WIDTH,
    )


def test_a_fresh_state_loads_the_step_data_position_and_rollout_saved(tmp_path: Path) -> None:
    """Saved at step 3 of a run training twice on each rollout (so the checkpoint holds the
    rollout): a new TrainState, its step never set, gets step 3, the data position (the next
    batch is the saving run's next batch) and the rollout back. Before, the state's own step
    (0, a rollout's first update) shaped the load, which then had no tensors to read the
    rollout into (KeyError), unless the loop set the step first."""
    config = Config(
        job=Job(dump_folder=str(tmp_path)),
        training=Training(steps=4, seq_len=WIDTH, local_batch_size=2),
        metrics=Metrics(tensorboard=False),
        checkpoint=Checkpoint(enable=True),
    )
    engine = Engine(config, CPU)
    saved = _state(config, engine)
    batches = iter(saved.loader)
    for _ in range(3):
        next(batches)
    rows = {"input_ids": torch.arange(10).view(2, 5), "advantages": torch.tensor([0.5, -0.5])}
    saved.step, saved.tokens_seen = 3, 96
    saved.rollout = ([rows], {"reward_mean": torch.tensor(0.25)})
    engine.save(3, saved, wait=True)
    following = next(batches)

    again = Engine(config, CPU)
    fresh = _state(config, again)
    assert fresh.step == 0
    assert again.load(fresh) == 3
    assert (fresh.step, fresh.tokens_seen) == (3, 96)
    assert fresh.rollout is not None
    (got,), metrics = fresh.rollout
    assert got.keys() == rows.keys()
    assert all(torch.equal(got[key], rows[key]) for key in rows)  # at its own width, 5
    assert metrics == {"reward_mean": torch.tensor(0.25)}
    resumed = next(iter(fresh.loader))
    assert resumed.keys() == following.keys()
    assert all(torch.equal(resumed[key], following[key]) for key in following)
