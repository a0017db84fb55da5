"""The Engine: the prepared, parallelized model of a config with its optimizer, scheduler,
meshes and checkpoints, for any training loop to drive (``docs/engine.md``).

Importing this package loads every built-in component, so every built-in config rule and
objective is registered."""

# The built-in config rules run in this order: degrees, model fit, attention backend.
import temper.parallel.dims  # noqa: F401, I001
import temper.models  # noqa: F401
import temper.kernels.attention  # noqa: F401
import temper.objectives  # noqa: F401  (registers the built-in objectives)
from temper.engine.checkpointing import Stateful
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
    "build_meta_model",
    "build_run_model",
    "load_run_tokenizer",
    "tokenizer_flag",
]
