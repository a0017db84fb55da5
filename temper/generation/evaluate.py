"""Greedy answers for evaluation: what a model answers, not what it would predict with the
answer in front of it. Any rollout engine can answer (``engine_answers``): the model's own
decoding, or a vLLM server holding the same weights (``scripts/evaluate.py --engine vllm``,
validation during a run with ``--rollout.engine vllm``)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from torch import nn

from temper.generation.engines import NativeEngine, RolloutEngine, SamplingParams


def greedy_answers(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    decode: Callable[[list[int]], str],
    *,
    max_new_tokens: int,
    stop_tokens: Collection[int],
    batch_size: int = 64,
) -> list[str]:
    """Each prompt's greedy completion by ``model`` itself (the native engine: eval mode for
    the call, left as it was)."""
    return engine_answers(
        NativeEngine(model),
        prompts,
        decode,
        max_new_tokens=max_new_tokens,
        stop_tokens=stop_tokens,
        batch_size=batch_size,
    )


def engine_answers(
    sampler: RolloutEngine,
    prompts: Sequence[Sequence[int]],
    decode: Callable[[list[int]], str],
    *,
    max_new_tokens: int,
    stop_tokens: Collection[int],
    batch_size: int = 64,
) -> list[str]:
    """Each prompt's greedy completion by ``sampler`` as text, without its stop token."""
    params = SamplingParams(max_new_tokens, stop_tokens=frozenset(stop_tokens))
    texts = []
    for start in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[start : start + batch_size]]
        texts += sampler.generate(chunk, params).texts(decode, params.stop_tokens)
    return texts
