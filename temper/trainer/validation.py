"""Validation during training: every ``validation.interval`` steps, the objective's mean loss
over the same fixed batches (``validation.steps`` global batches, laid out as training's),
logged as ``val_loss``.

It reads its own loader, rewound to its start each time, runs the model in eval mode without
gradients and draws no random numbers, so the training stream and the weights it sees are
exactly those of a run without validation.
"""

from __future__ import annotations

import torch

from temper.config import Config
from temper.data.loader import build_validation_loader
from temper.engine import Engine
from temper.objectives import Objective
from temper.parallel.collectives import all_reduce_sum


class Validation:
    def __init__(self, config: Config, engine: Engine, objective: Objective, grad_accum: int):
        self.interval = config.validation.interval
        self.engine = engine
        self.objective = objective
        self.micro_batches = config.validation.steps * grad_accum
        dims = engine.dims
        self.loader = build_validation_loader(config, engine.tokenizer, dims.dp_rank, dims.dp)
        self._start = self.loader.state_dict()

    def due(self, step: int, last: bool) -> bool:
        return step % self.interval == 0 or last

    @torch.no_grad()
    def run(self) -> dict[str, torch.Tensor]:
        """``val_loss``: the summed loss over every rank's batches / their summed count."""
        engine, objective = self.engine, self.objective
        self.loader.load_state_dict(self._start)
        batches = iter(self.loader)
        loss_sum = torch.zeros((), device=engine.device)
        count = torch.zeros((), device=engine.device)
        engine.model.eval()
        try:
            for _ in range(self.micro_batches):
                batch = engine.prepare_batch(next(batches))
                with engine.autocast():
                    loss, _, _ = objective.loss(engine.model, batch)
                loss_sum += loss.float()
                count += objective.count(batch)
        finally:
            engine.model.train()
        return {"val_loss": all_reduce_sum(loss_sum) / all_reduce_sum(count)}


def build_validation(
    config: Config, engine: Engine, objective: Objective, grad_accum: int
) -> Validation | None:
    """The run's validation, or None when ``validation.interval`` is 0."""
    if not config.validation.interval:
        return None
    return Validation(config, engine, objective, grad_accum)
