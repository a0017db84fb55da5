"""Config tree, recipe loading and typed CLI overrides."""

from temper.config.config import (
    Checkpoint,
    Config,
    ConfigError,
    Data,
    Job,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Training,
)
from temper.config.loading import load_config, save_config

__all__ = [
    "Checkpoint",
    "Config",
    "ConfigError",
    "Data",
    "Job",
    "LRScheduler",
    "Metrics",
    "Model",
    "Optimizer",
    "Parallelism",
    "Training",
    "load_config",
    "save_config",
]
