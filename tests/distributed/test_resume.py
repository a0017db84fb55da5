"""Resuming: 8 steps straight equals 4 steps, a crash, and a resume to 8, at any layout."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
from harness import run_on_ranks

from temper.config import Config
from temper.recipes.llama3 import llama3_debug

STEPS, CRASH_AFTER, GLOBAL_BATCH = 8, 4, 4


def resume_config(folder: Path, world: int, optimizer: str = "adamw") -> Config:
    config = llama3_debug()
    config.optimizer.name = optimizer
    config.job.dump_folder = str(folder)
    config.training.steps = STEPS
    config.training.seq_len = 32
    config.training.local_batch_size = GLOBAL_BATCH // world
    config.training.global_batch_size = GLOBAL_BATCH
    config.training.deterministic = True
    config.metrics.tensorboard = False
    config.checkpoint.enable = True
    config.checkpoint.interval = CRASH_AFTER
    return config


class SimulatedCrash(RuntimeError):
    pass


def _train_rank(config: Config, crash_after: int | None) -> dict | None:
    """Train (crashing at the start of step crash_after + 1 if asked); rank 0's results."""
    from temper.trainer import Trainer

    trainer = Trainer(config)
    if crash_after is not None:
        step = trainer.train_step

        def crashing_step(micro_batches):
            if trainer.state.step == crash_after:
                raise SimulatedCrash(f"killed before step {crash_after + 1}")
            return step(micro_batches)

        trainer.train_step = crashing_step
    resumed_from = trainer.state.step
    with contextlib.suppress(SimulatedCrash):
        trainer.train()
    data = trainer.state.state_dict()["dataloader"]  # every rank's lanes, gathered
    if not trainer.engine.runtime.is_main:
        return None
    metrics = Path(config.job.dump_folder) / "metrics.jsonl"
    return {
        "rows": [json.loads(line) for line in metrics.read_text().splitlines()],
        "resumed_from": resumed_from,
        "data": data,
        "tokens_seen": trainer.state.tokens_seen,
    }


def run(config: Config, world: int, crash_after: int | None = None) -> dict:
    if world == 1:
        return _train_rank(config, crash_after)
    return run_on_ranks(_train_rank, world, config, crash_after)[0]


def losses(result: dict) -> list[float]:
    return [row["loss"] for row in result["rows"]]


@pytest.mark.parametrize(
    ("world", "optimizer"),
    [
        (1, "adamw"),
        (2, "adamw"),
        pytest.param(2, "muon", marks=pytest.mark.slow),
        pytest.param(1, "adamw8bit", marks=pytest.mark.slow),
    ],
    ids=lambda v: str(v),
)
def test_resume_is_bitwise_identical(tmp_path: Path, world: int, optimizer: str) -> None:
    """Muon's momentum buffers (sharded like their matrices) and its AdamW moments come back
    exactly too, and so do torchao's 8-bit moments (codes and block scales)."""
    straight = run(resume_config(tmp_path / "straight", world, optimizer), world)
    crashed = run(
        resume_config(tmp_path / "resumed", world, optimizer), world, crash_after=CRASH_AFTER
    )
    assert [row["step"] for row in crashed["rows"]] == list(range(1, CRASH_AFTER + 1))
    resumed = run(resume_config(tmp_path / "resumed", world, optimizer), world)
    assert resumed["resumed_from"] == CRASH_AFTER
    assert [row["step"] for row in resumed["rows"]] == list(range(1, STEPS + 1))
    assert losses(resumed) == losses(straight)  # bitwise, in deterministic mode
    assert [r["grad_norm"] for r in resumed["rows"]] == [r["grad_norm"] for r in straight["rows"]]
    assert resumed["data"] == straight["data"]
    assert resumed["tokens_seen"] == straight["tokens_seen"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("new_world", "optimizer"), [(1, "adamw"), (4, "adamw"), (1, "muon")], ids=lambda v: str(v)
)
def test_resume_at_another_world_size(tmp_path: Path, new_world: int, optimizer: str) -> None:
    """Saved by FSDP 2, resumed by one process or by FSDP 4: DCP reshards, the data position
    is per lane, gathered from every rank, so the losses continue as in the uninterrupted
    run. (Muon: its momentum
    shards join into whole matrices; Newton-Schulz in float32, see test_muon_parallel.py.)"""

    def config(folder: Path, world: int) -> Config:
        config = resume_config(folder, world, optimizer)
        config.optimizer.muon_ns_dtype = "float32"
        return config

    straight = run(config(tmp_path / "straight", 1), 1)
    run(config(tmp_path / "run", 2), 2, crash_after=CRASH_AFTER)
    resumed = run(config(tmp_path / "run", new_world), new_world)
    assert resumed["resumed_from"] == CRASH_AFTER
    assert losses(resumed) == pytest.approx(losses(straight), rel=1e-5)
    assert resumed["data"] == straight["data"]  # every lane where it would be: nothing lost


def test_mismatched_structure_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resuming, or starting from the checkpoint's weights, with another flavor is refused
    from the meta model: the 1B flavor's weights are never allocated."""
    from temper.config import ConfigError
    from temper.trainer import Trainer

    config = resume_config(tmp_path, 1)
    config.training.steps = 2
    config.checkpoint.interval = 2
    Trainer(config).train()
    config.model.flavor = "1b"

    def materialize(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was materialized before the checkpoint was checked")

    monkeypatch.setattr("temper.engine.engine.materialize", materialize)
    with pytest.raises(ConfigError, match=r"model.args.dim: checkpoint 256, config 2048"):
        Trainer(config)
    config.checkpoint.resume = "never"
    config.checkpoint.initial_load = str(tmp_path / "checkpoints" / "step-2")
    with pytest.raises(ConfigError, match=r"holds another model: model.args.dim: checkpoint 256"):
        Trainer(config)
