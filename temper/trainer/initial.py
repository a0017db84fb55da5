"""A run's starting weights trained by another recipe first (``checkpoint.initial_recipe``),
and a checkpoint exported as an HF folder beside the run (``checkpoint.hf_export``)."""

from __future__ import annotations

import shlex
import shutil
from collections.abc import Callable
from pathlib import Path

from temper.checkpoint.convert import dcp_to_hf
from temper.checkpoint.manager import checkpoint_dir
from temper.config import Config, load_config


def train_initial_checkpoint(config: Config, train: Callable[[Config], object], main: bool) -> str:
    """Train `checkpoint.initial_recipe` (``module:function``, then any overrides) into
    ``<dump_folder>/initial`` with ``train`` and return its final checkpoint, the run's
    starting weights. A finished earlier run is reused, so a restarted run does not train it
    again."""
    recipe, *overrides = shlex.split(config.checkpoint.initial_recipe)
    module, _, function = recipe.partition(":")
    first = load_config(module, function, overrides)
    first.job.dump_folder = str(Path(config.job.dump_folder) / "initial")
    first.checkpoint.enable = True
    first.metrics.tensorboard = config.metrics.tensorboard
    final = checkpoint_dir(
        Path(first.job.dump_folder) / first.checkpoint.folder, first.training.steps
    )
    if not final.is_dir():
        if main:
            print(
                f"temper: no checkpoint.initial_load; training {module}:{function} first",
                flush=True,
            )
        train(first)
    return str(final)


def export_hf(config: Config, step: int) -> Path:
    """``dcp-to-hf`` of checkpoint ``step`` into ``<job.dump_folder>/hf/step-<step>``."""
    output = Path(config.job.dump_folder) / "hf" / f"step-{step}"
    root = Path(config.job.dump_folder) / config.checkpoint.folder
    if output.exists():  # a step trained again after a resume: its new weights replace it
        shutil.rmtree(output)
    dcp_to_hf(checkpoint_dir(root, step), output)
    return output
