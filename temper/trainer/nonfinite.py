"""Steps whose loss or gradient norm is not finite: skipped while
``training.skip_nonfinite`` allows one more, else the run stops naming the steps skipped."""

from __future__ import annotations

import torch

from temper.engine import NonFiniteError


def skip_nonfinite(
    error: NonFiniteError, step: int, skipped: list[int], budget: int, lr: float
) -> tuple[dict[str, torch.Tensor], str]:
    """The metrics of step ``step``, which ``engine.step`` refused, and its console line;
    ``skipped`` gains the step. A skipped step applies no update and leaves the learning-rate
    schedule where it was (``lr`` is the one it would have had); its data is consumed, so the
    next step trains on the next batch. Past the budget: NonFiniteError saying why."""
    if len(skipped) >= budget:
        raise NonFiniteError(
            nonfinite_stop_message(step, error.values, skipped, budget),
            error.values,
            error.grad_norm,
        ) from None
    skipped.append(step)
    line = (
        f"temper: step {step}: {error.values} is not finite; skipped it without an update "
        f"({len(skipped)} of training.skip_nonfinite {budget})"
    )
    metrics = {
        "grad_norm": torch.tensor(error.grad_norm),
        "lr": torch.tensor(lr),
        "skipped": torch.tensor(1.0),
    }
    return metrics, line


def nonfinite_stop_message(step: int, values: str, skipped: list[int], budget: int) -> str:
    """Why a run stopped at a non-finite step, naming the steps it skipped before."""
    if budget == 0:
        allowance = "; --training.skip_nonfinite N would skip up to N such steps"
    else:
        earlier = ", ".join(map(str, skipped))
        allowance = f" after skipping steps {earlier} (training.skip_nonfinite {budget})"
    return (
        f"step {step}: {values} is not finite; the update was not applied and training "
        f"stopped{allowance}. Lower optimizer.lr or check the data."
    )
