"""The trainer loop and its metrics."""

from temper.trainer.trainer import NonFiniteError, Trainer

__all__ = ["NonFiniteError", "Trainer"]
