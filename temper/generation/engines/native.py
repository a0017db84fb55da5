"""The ``native`` rollout engine: the training model samples its own rollouts with
``temper.generation.generate``. Exact (the sampler is the policy, in the loss's precision) and
needs no other process; its weights are the trainer's, so ``update_weights`` has nothing to
do."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.distributed import ProcessGroup

from temper.generation.decoding import Generation, generate
from temper.generation.engines.base import SamplingParams


class NativeEngine:
    """``generate`` on ``model`` in eval mode (restored after), with its lockstep group
    (expert parallelism) and compiled decode step if asked. Under FSDP the caller may gather
    the weights around more than the decoding (a rollout gathers once for all its
    forwards)."""

    def __init__(
        self, model: nn.Module, lockstep_group: ProcessGroup | None = None, compile: bool = False
    ) -> None:
        self.model = model
        self.lockstep_group = lockstep_group
        self.compile = compile

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Generation:
        was_training = self.model.training
        self.model.eval()
        try:
            out = self._generate(prompts, params, generator)
        finally:
            self.model.train(was_training)
        out.finish_reasons = finish_reasons(out, params)
        return out

    def _generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Generation:
        return generate(
            self.model,
            prompts,
            params.max_new_tokens,
            params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            stop_tokens=params.stop_tokens,
            generator=generator,
            return_log_probs=True,
            lockstep_group=self.lockstep_group,
            compile=self.compile,
        )

    def update_weights(self, weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]) -> None:
        """Nothing to take: the model samples with the weights it trains."""

    def close(self) -> None:
        """Nothing held."""


def finish_reasons(out: Generation, params: SamplingParams) -> list[str]:
    """ "stop" for a row that ended on a stop token, "length" for one cut at max_new_tokens."""
    reasons = []
    for row, n in zip(out.tokens.tolist(), out.lengths.tolist(), strict=True):
        reasons.append("stop" if n and row[n - 1] in params.stop_tokens else "length")
    return reasons
