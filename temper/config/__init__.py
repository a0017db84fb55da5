"""Config tree, recipe loading and typed CLI overrides."""

from temper.config.config import (
    ActivationCheckpoint,
    Checkpoint,
    Compile,
    Config,
    ConfigError,
    Data,
    Job,
    Kernels,
    LoRA,
    LRScheduler,
    Metrics,
    Model,
    Objective,
    Optimizer,
    Parallelism,
    Training,
)
from temper.config.loading import load_config, save_config

__all__ = [
    "ActivationCheckpoint",
    "Checkpoint",
    "Compile",
    "Config",
    "ConfigError",
    "Data",
    "Job",
    "Kernels",
    "LoRA",
    "LRScheduler",
    "Metrics",
    "Model",
    "Objective",
    "Optimizer",
    "Parallelism",
    "Training",
    "load_config",
    "save_config",
]
