"""What an RL objective (or a user's own loop) asks of a sampler: completions of token-id
prompts with their log-probabilities, and the new weights after each update.

Two engines implement it: ``native`` (the training model's own KV-cache decoding,
``temper.generation.engines.native``) and ``vllm`` (a vLLM server,
``temper.generation.engines.vllm``). The objective scores what they return with its own
forward, so an engine's numerics only enter through the sampled tokens and their
log-probabilities (``sampler_log_probs``), which the loss may correct against.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from temper.generation.decoding import Generation


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: the same meaning in every engine (see ``sample_next``)."""

    max_new_tokens: int
    temperature: float = 0.0
    """0 is greedy."""
    top_k: int | None = None
    top_p: float = 1.0
    stop_tokens: frozenset[int] = frozenset()
    """A row ends after the first of these (it is kept, and counted in its length)."""


class RolloutEngine(Protocol):
    """A sampler an RL loop drives: ``generate``, then after each optimizer step
    ``update_weights``; ``close`` when the run ends."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Generation:
        """Completions of ``prompts`` (token ids), one per prompt: tokens [b, max_new_tokens],
        lengths [b], log_probs [b, max_new_tokens] (each sampled token's log-probability under
        softmax(logits / temperature), 1 when greedy, without top-k/top-p) and finish
        reasons. ``generator`` seeds the sampling, so a rollout is drawn again alike."""
        ...

    def update_weights(self, weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]) -> None:
        """Take the trainer's current weights: ``weights()`` yields ``(hf_name, full tensor)``
        one at a time, as ``Engine.hf_state_dict`` does. Every rank calls this (under FSDP
        each tensor is a collective); an engine that shares the trainer's weights never
        calls ``weights``."""
        ...

    def close(self) -> None:
        """Release what the engine holds (a server it started)."""
        ...
