"""The trainer loop on the Engine, its state and its metrics."""

from temper.engine import NonFiniteError
from temper.trainer.trainer import Trainer

__all__ = ["NonFiniteError", "Trainer"]
