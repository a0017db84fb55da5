"""The Engine: the prepared, parallelized model of a config with its optimizer, scheduler,
meshes and checkpoints, for any training loop to drive (``docs/engine.md``).

Importing this package loads every built-in component, so every built-in config rule and
objective is registered."""

import temper.components  # noqa: F401, I001  (every built-in config rule, in order)
from temper.engine.checkpointing import Stateful, StepShaped
from temper.engine.engine import (
    Engine,
    NonFiniteError,
    build_meta_model,
    build_run_model,
    load_run_tokenizer,
    tokenizer_flag,
)

__all__ = [
    "Engine",
    "NonFiniteError",
    "Stateful",
    "StepShaped",
    "build_meta_model",
    "build_run_model",
    "load_run_tokenizer",
    "tokenizer_flag",
]
