"""Greedy answers for evaluation: what a model answers, not what it would predict with the
answer in front of it."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch
from torch import nn

from temper.generation.decoding import generate


@torch.no_grad()
def greedy_answers(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    decode: Callable[[list[int]], str],
    *,
    max_new_tokens: int,
    stop_tokens: Collection[int],
    batch_size: int = 64,
) -> list[str]:
    """Each prompt's greedy completion as text, without its stop token; the model is put in
    eval mode for the call and left as it was."""
    was_training = model.training
    model.eval()
    texts = []
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = [list(p) for p in prompts[start : start + batch_size]]
            out = generate(model, chunk, max_new_tokens, stop_tokens=stop_tokens)
            texts += out.texts(decode, stop_tokens)
    finally:
        model.train(was_training)
    return texts
