"""Resuming: 8 steps straight equals 4 steps, a crash, and a resume to 8, at any layout."""

from __future__ import annotations

from pathlib import Path

import pytest
from resuming import SAVED_AT, STEPS, resume_config, run

from temper.config import Config
from temper.recipes.llama3 import llama3_debug


def config_for(folder: Path, world: int, optimizer: str = "adamw") -> Config:
    config = resume_config(llama3_debug, folder, world)
    config.optimizer.name = optimizer
    return config


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
    straight = run(config_for(tmp_path / "straight", world, optimizer), world)
    crashed = run(config_for(tmp_path / "resumed", world, optimizer), world, crash_after=SAVED_AT)
    assert [row["step"] for row in crashed["rows"]] == list(range(1, SAVED_AT + 1))
    resumed = run(config_for(tmp_path / "resumed", world, optimizer), world)
    assert resumed["resumed_from"] == SAVED_AT
    assert [row["step"] for row in resumed["rows"]] == list(range(1, STEPS + 1))
    assert resumed["losses"] == straight["losses"]  # bitwise, in deterministic mode
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
        config = config_for(folder, world, optimizer)
        config.optimizer.muon_ns_dtype = "float32"
        return config

    straight = run(config(tmp_path / "straight", 1), 1)
    run(config(tmp_path / "run", 2), 2, crash_after=SAVED_AT)
    resumed = run(config(tmp_path / "run", new_world), new_world)
    assert resumed["resumed_from"] == SAVED_AT
    assert resumed["losses"] == pytest.approx(straight["losses"], rel=1e-5)
    assert resumed["data"] == straight["data"]  # every lane where it would be: nothing lost


def test_mismatched_structure_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resuming, or starting from the checkpoint's weights, with another flavor is refused
    from the meta model: the 1B flavor's weights are never allocated."""
    from temper.config import ConfigError
    from temper.trainer import Trainer

    config = config_for(tmp_path, 1)
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
