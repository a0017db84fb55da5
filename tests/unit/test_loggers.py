"""W&B and MLflow beside TensorBoard: used only when asked for, each logged row the same as
metrics.jsonl's; one config error line when asked for and not installed. The packages are
stand-ins put in ``sys.modules`` (no network, no account)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from temper.train import main

RUN = [
    "--training.steps", "2",
    "--training.seq_len", "16",
    "--training.local_batch_size", "2",
    "--metrics.no-tensorboard",
]  # fmt: skip


class FakeWandb(ModuleType):
    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits: list[dict[str, Any]] = []
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.finished = 0

    def init(self, **kwargs: Any) -> FakeWandb:
        self.inits.append(kwargs)
        return self

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, dict(metrics)))

    def finish(self) -> None:
        self.finished += 1


class FakeMlflow(ModuleType):
    def __init__(self) -> None:
        super().__init__("mlflow")
        self.calls: list[tuple[str, Any]] = []
        self.rows: list[tuple[int, dict[str, float]]] = []

    def set_experiment(self, name: str) -> None:
        self.calls.append(("set_experiment", name))

    def start_run(self, run_name: str) -> None:
        self.calls.append(("start_run", run_name))

    def log_params(self, params: dict[str, Any]) -> None:
        self.calls.append(("log_params", params))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, dict(metrics)))

    def end_run(self) -> None:
        self.calls.append(("end_run", None))


def jsonl_rows(folder: Path) -> list[tuple[int, dict[str, float]]]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [(row.pop("step"), row) for row in rows]


def test_wandb_and_mlflow_get_every_logged_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb, mlflow = FakeWandb(), FakeMlflow()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    run = tmp_path / "my-run"
    flags = ["--metrics.wandb", "--metrics.mlflow", "--metrics.project", "proj"]
    assert main([*RUN, *flags, "--job.dump_folder", str(run)]) == 0

    expected = jsonl_rows(run)
    assert [step for step, _ in expected] == [1, 2]
    assert wandb.rows == expected and mlflow.rows == expected
    [init] = wandb.inits
    assert (init["project"], init["name"], init["dir"]) == ("proj", "my-run", str(run))
    assert init["config"]["training"]["steps"] == 2
    assert wandb.finished == 1
    names = [name for name, _ in mlflow.calls]
    assert names == ["set_experiment", "start_run", "log_params", "end_run"]
    assert mlflow.calls[0][1] == "proj" and mlflow.calls[1][1] == "my-run"
    assert mlflow.calls[2][1]["training.steps"] == 2


def test_asked_for_and_not_installed_is_one_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow raises ImportError
    code = main(["--check_only", *RUN, "--metrics.mlflow", "--job.dump_folder", str(tmp_path)])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "temper: config error: metrics.mlflow: the mlflow package is not installed in this "
        "environment (pip install mlflow), or drop --metrics.mlflow"
    ]


def test_not_asked_for_is_never_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    assert main([*RUN, "--job.dump_folder", str(tmp_path)]) == 0
