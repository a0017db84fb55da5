"""The resume tests' scaffolding: a short deterministic run that saves every ``SAVED_AT``
steps, a rank that trains it (crashing once a step is done, if asked), and running that in one
process or on ranks."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path

from harness import run_on_ranks

from temper.config import Config

STEPS, SAVED_AT, GLOBAL_BATCH = 8, 4, 4


def resume_config(recipe: Callable[[], Config], folder: Path, world: int, ep: int = 1) -> Config:
    config = recipe()
    config.job.dump_folder = str(folder)
    config.training.steps = STEPS
    config.training.seq_len = 32
    config.training.local_batch_size = GLOBAL_BATCH // world
    config.training.global_batch_size = GLOBAL_BATCH
    config.training.deterministic = True
    config.metrics.tensorboard = False
    config.parallelism.ep = ep
    config.checkpoint.enable = True
    config.checkpoint.interval = SAVED_AT
    return config


class SimulatedCrash(RuntimeError):
    pass


def results(config: Config) -> dict:
    """The run's metrics rows, with their losses and steps."""
    folder = Path(config.job.dump_folder)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {
        "rows": rows,
        "losses": [row["loss"] for row in rows],
        "steps": [row["step"] for row in rows],
    }


def _train_rank(config: Config, crash_after: int | None) -> dict | None:
    """Train, crashing once step `crash_after` is done (after any pending asynchronous save
    has landed: the crash tests the save, not a race with it); rank 0's results."""
    from temper.trainer import Trainer

    trainer = Trainer(config)
    if crash_after is not None:
        step = trainer.train_step

        def crashing_step(micro_batches):
            if trainer.state.step == crash_after:
                trainer.engine.checkpointer.wait()
                raise SimulatedCrash(f"killed after step {crash_after}")
            return step(micro_batches)

        trainer.train_step = crashing_step
    resumed_from = trainer.state.step
    with contextlib.suppress(SimulatedCrash):
        trainer.train()
    # Every lane's position, gathered from all ranks: the next rows at any layout.
    data = trainer.state.state_dict()["dataloader"]
    if not trainer.engine.runtime.is_main:
        return None
    return {
        **results(config),
        "resumed_from": resumed_from,
        "ep": trainer.engine.dims.ep,
        "data": data,
        "tokens_seen": trainer.state.tokens_seen,
    }


def run(config: Config, world: int, crash_after: int | None = None) -> dict:
    if world == 1:
        return _train_rank(config, crash_after)
    return run_on_ranks(_train_rank, world, config, crash_after)[0]
