"""The trainer loop on the Engine, its state and its metrics.

``Trainer`` and ``NonFiniteError`` load on first use, so the light parts (the console's
lines, the finished-run check that answers "nothing to do") import without the Engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from temper.engine import NonFiniteError
    from temper.trainer.trainer import Trainer

__all__ = ["NonFiniteError", "Trainer"]


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from temper.trainer.trainer import Trainer

        return Trainer
    if name == "NonFiniteError":
        from temper.engine import NonFiniteError

        return NonFiniteError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
