"""The recipe module of the restart test: on the first launch, rank 1 SIGKILLs itself in the
middle of step ``KILL_STEP``, after its backward and before the optimizer step, while rank 0
waits for it in the gradient-norm all-reduce. A restarted group (torchrun sets
``TORCHELASTIC_RESTART_COUNT``) trains normally."""

from __future__ import annotations

import os
import signal
from typing import Any

from temper.config import Config
from temper.recipes.llama3 import llama3_debug
from temper.trainer.trainer import Trainer

KILL_STEP = 5


def run() -> Config:
    return llama3_debug()


def _die(*args: Any, **kwargs: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_rank_mid_step() -> None:
    train_step = Trainer.train_step

    def dying_step(self: Trainer, micro_batches: Any) -> Any:
        if self.state.step == KILL_STEP - 1:
            self.engine.step = _die
        return train_step(self, micro_batches)

    Trainer.train_step = dying_step


if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    _kill_rank_mid_step()
