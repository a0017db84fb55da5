"""Validation during training: every ``validation.interval`` steps, the objective's mean loss
over the same fixed batches (``validation.steps`` global batches, laid out as training's),
logged as ``val_loss``; and, with ``validation.generate``, the exact match of greedy answers
to held-out prompts, logged as ``val_exact_match``. An RL run's answers come from its rollout
engine (``--rollout.engine vllm``: the server, which holds the weights of the update just
taken, since validation follows the weight push); any other run's from the model itself.

It reads its own loader, rewound to its start each time, runs the model in eval mode without
gradients and draws no random numbers (answers are greedy), so the training stream and the
weights it sees are exactly those of a run without validation.
"""

from __future__ import annotations

import torch

from temper.config import Config
from temper.data.chat import load_chat_template, stop_token_ids
from temper.data.loader import build_validation_loader, validation_prompts
from temper.engine import Engine
from temper.generation.engines import NativeEngine, RolloutEngine
from temper.generation.evaluate import engine_answers
from temper.objectives import Objective
from temper.objectives.rewards import exact_match
from temper.parallel.collectives import all_reduce_sum


class Validation:
    def __init__(
        self,
        config: Config,
        engine: Engine,
        objective: Objective,
        grad_accum: int,
        sampler: RolloutEngine | None = None,
    ):
        self.interval = config.validation.interval
        self.engine = engine
        self.sampler = sampler or NativeEngine(engine.model)
        """What answers the held-out prompts: the run's rollout engine, else the model."""
        self.objective = objective
        self.micro_batches = config.validation.steps * grad_accum
        dims, tokenizer = engine.dims, engine.tokenizer
        self.loader = None
        if config.data.format != "prompt":  # prompt rows have no loss of their own
            self.loader = build_validation_loader(config, tokenizer, dims.dp_rank, dims.dp)
            self._start = self.loader.state_dict()
        self.prompts = []
        if config.validation.generate:
            if config.validation.generate < dims.dp:
                raise ValueError(
                    f"validation.generate {config.validation.generate} gives some of the "
                    f"{dims.dp} data-parallel ranks no prompt; give at least {dims.dp}"
                )
            self.prompts = validation_prompts(config, tokenizer, dims.dp_rank, dims.dp)
            data = config.data
            template = load_chat_template(
                data.chat_template, data.tokenizer_path or config.model.hf_path
            )
            self.stop_tokens = stop_token_ids(tokenizer, template)
            self.max_new_tokens = config.validation.max_new_tokens

    def due(self, step: int, last: bool) -> bool:
        return step % self.interval == 0 or last

    def run(self) -> dict[str, torch.Tensor]:
        metrics = {}
        if self.loader is not None:
            metrics["val_loss"] = self.loss()
        if self.prompts:
            metrics["val_exact_match"] = self.exact_match()
        return metrics

    @torch.no_grad()
    def loss(self) -> torch.Tensor:
        """The summed loss over every rank's batches / their summed count."""
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
        return all_reduce_sum(loss_sum) / all_reduce_sum(count)

    def exact_match(self) -> torch.Tensor:
        """Share of the held-out prompts (all ranks) whose greedy answer is the record's."""
        engine = self.engine
        with engine.autocast():
            answers = engine_answers(
                self.sampler,
                [ids for ids, _ in self.prompts],
                engine.tokenizer.decode,
                max_new_tokens=self.max_new_tokens,
                stop_tokens=self.stop_tokens,
                batch_size=len(self.prompts),  # one call a rank: its weights are gathered once
            )
        pairs = zip(answers, self.prompts, strict=True)
        hits = sum(exact_match("", got, want) for got, (_, want) in pairs)
        counts = torch.tensor([hits, len(self.prompts)], dtype=torch.float32, device=engine.device)
        hits, total = all_reduce_sum(counts).tolist()
        return torch.tensor(hits / total)


def build_validation(
    config: Config,
    engine: Engine,
    objective: Objective,
    grad_accum: int,
    sampler: RolloutEngine | None = None,
) -> Validation | None:
    """The run's validation, or None when ``validation.interval`` is 0; ``sampler`` is an RL
    run's rollout engine."""
    if not config.validation.interval:
        return None
    return Validation(config, engine, objective, grad_accum, sampler)
