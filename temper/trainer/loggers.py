"""Optional experiment trackers beside TensorBoard: Weights & Biases (``--metrics.wandb``) and
MLflow (``--metrics.mlflow``). Each is imported only when asked for; rank 0 writes to it
every metrics row that goes to metrics.jsonl."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from temper.config import Config, ConfigError


class StepLogger(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}
"""``metrics.<field>`` -> the package it needs."""


def _require(field: str) -> ModuleType:
    try:
        return importlib.import_module(PACKAGES[field])
    except ImportError:
        raise ConfigError(
            f"metrics.{field}: the {PACKAGES[field]} package is not installed in this "
            f"environment (pip install {PACKAGES[field]}), or drop --metrics.{field}"
        ) from None


def check_loggers(config: Config) -> None:
    """The pre-flight's check: every tracker asked for can be imported (ConfigError naming
    the flag)."""
    for field in PACKAGES:
        if getattr(config.metrics, field):
            _require(field)


def open_loggers(config: Config) -> list[StepLogger]:
    """The trackers ``config.metrics`` asks for, each started as a run named after the run
    folder, under ``metrics.project``, holding the resolved config."""
    name = Path(config.job.dump_folder).resolve().name
    loggers: list[StepLogger] = []
    if config.metrics.wandb:
        loggers.append(WandbLogger(_require("wandb"), config, name))
    if config.metrics.mlflow:
        loggers.append(MlflowLogger(_require("mlflow"), config, name))
    return loggers


class WandbLogger:
    def __init__(self, wandb: ModuleType, config: Config, name: str) -> None:
        self.run = wandb.init(
            project=config.metrics.project,
            name=name,
            config=config.to_dict(),
            dir=config.job.dump_folder,
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowLogger:
    def __init__(self, mlflow: ModuleType, config: Config, name: str) -> None:
        self.mlflow = mlflow
        mlflow.set_experiment(config.metrics.project)
        mlflow.start_run(run_name=name)
        mlflow.log_params(_flat(config.to_dict()))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.mlflow.log_metrics(metrics, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"training": {"steps": 60}}`` -> ``{"training.steps": 60}``: MLflow's params are
    flat."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= _flat(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat
