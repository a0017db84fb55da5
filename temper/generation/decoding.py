"""Decoding with the training model itself: prefill the prompts, then one token per step.

Two decode steps run the same model: the eager one, with a cache that grows by a column per
token, and a compiled one (``compile=True``, gpt-fast's approach) on a ``StaticKVCache``,
whose buffers never change shape and whose filled length the graph takes as a dynamic
size, so ``torch.compile`` builds one graph for the step and runs it for every token. The
prefill (one forward over every prompt of the batch) runs eagerly in both.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from temper.generation.fsdp import gathered_weights
from temper.generation.sampling import (
    check_sampling,
    greedy_pick,
    sample_next,
    sample_with_log_prob,
    token_log_prob,
)
from temper.models.layers.kv_cache import KVCache, StaticKVCache

Prompts = torch.Tensor | Sequence[Sequence[int] | torch.Tensor]
"""Token ids [b, s] of equal-length prompts, or a list of prompts of any lengths."""


@dataclass
class Generation:
    """What ``generate`` returns; every tensor is on the model's device."""

    tokens: torch.Tensor
    """[b, max_new_tokens] int64: each row's new tokens, then ``pad_id`` once it stopped."""
    lengths: torch.Tensor
    """[b] int64: new tokens per row, its stop token included."""
    log_probs: torch.Tensor | None = None
    """[b, max_new_tokens] fp32 (when asked): each new token's log-probability under the
    model's distribution at the sampling temperature (1 when greedy), without top-k/top-p:
    what the trainer's forward gives the same tokens with its logits divided by that
    temperature; 0 after a row's end."""
    finish_reasons: list[str] | None = None
    """Per row (from a rollout engine): "stop" (ended on a stop token) or "length"."""

    def texts(self, decode: Callable[[list[int]], str], stop_tokens: Collection[int]) -> list[str]:
        """Each row's new tokens as text, without the stop token that ended it."""
        texts = []
        for row, n in zip(self.tokens.tolist(), self.lengths.tolist(), strict=True):
            ids = row[:n]
            texts.append(decode(ids[:-1] if ids and ids[-1] in stop_tokens else ids))
        return texts


@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids: Prompts,
    max_new_tokens: int,
    temperature: float = 0.0,
    *,
    top_k: int | None = None,
    top_p: float = 1.0,
    stop_tokens: Collection[int] = (),
    pad_id: int = 0,
    generator: torch.Generator | None = None,
    return_log_probs: bool = False,
    lockstep_group: ProcessGroup | None = None,
    compile: bool = False,
) -> Generation:
    """Up to ``max_new_tokens`` new tokens after each prompt, with a KV cache.

    Prompts are left-padded; each row's positions start at 0 at its first real token and
    attention never sees the padding, so a row decodes as it would alone. Temperature 0 is
    greedy; see ``sample_next`` for the rest. A row stops after any of ``stop_tokens``; its
    later columns hold ``pad_id`` (any int: it is never fed to the model). Under FSDP2 the
    weights are gathered once for the whole call (``gathered_weights``). With
    ``lockstep_group`` (expert parallelism: each token's forward is an all-to-all) every rank
    of the group decodes until all of them are done, one all-reduce of a done flag every
    ``STOP_CHECK_EVERY`` steps; a rank whose rows all stopped keeps running padded steps.

    ``compile``: decode with the compiled step on a static cache (module docstring); the
    first call for a model, batch size and rounded length compiles (seconds to minutes),
    later ones reuse it. Same tokens as the eager step up to float rounding.
    """
    check_sampling(temperature, top_k, top_p)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    ids, valid = left_pad(input_ids, device)
    batch = ids.shape[0]
    positions = (valid.cumsum(dim=1) - 1).clamp(min=0)
    # The last new token is returned, never fed back: it needs no column.
    columns = torch.cat([valid, valid.new_ones(batch, max_new_tokens - 1)], 1)
    if compile:
        length = -(-columns.shape[1] // STATIC_LENGTH_STEP) * STATIC_LENGTH_STEP
        cache: KVCache = StaticKVCache(columns, len(model.layers), max_len=length)
        step_fn = compiled_decode_step()
    else:
        cache, step_fn = KVCache(columns, len(model.layers)), decode_step
    stop = torch.tensor(sorted(stop_tokens), dtype=torch.long, device=device)
    tokens = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
    log_probs = torch.zeros(batch, max_new_tokens, device=device) if return_log_probs else None
    greedy = temperature == 0
    with gathered_weights(model):
        cache.open(ids.shape[1])
        logits = model(ids, positions, cache=cache)[:, -1].float()
        picked = None
        position = positions[:, -1:]
        for step in range(max_new_tokens):
            token, log_prob = _next_token(
                logits, picked, temperature, top_k, top_p, generator, log_probs is not None
            )
            # A finished row still runs (the batch moves together) on what it samples; what
            # follows its stop token is padded over after the loop (``_cut_at_stops``), so
            # pad_id never reaches the model and needs no embedding.
            tokens[:, step] = token
            if log_probs is not None:
                log_probs[:, step] = log_prob
            if step == max_new_tokens - 1 or _all_stopped(tokens, step, stop, lockstep_group):
                break
            position = position + 1
            cache.open(1)
            logits, picked = step_fn(model, token[:, None], position, cache, greedy)
    lengths = _cut_at_stops(tokens[:, : step + 1], log_probs, stop, pad_id)
    return Generation(tokens, lengths, log_probs)


def _next_token(
    logits: torch.Tensor,
    picked: torch.Tensor | None,
    temperature: float,
    top_k: int | None,
    top_p: float,
    generator: torch.Generator | None,
    with_log_prob: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The next tokens [b] from ``logits`` [b, vocab] (``picked`` when the compiled step
    already took the greedy ones) and, when asked, their log-probabilities [b]."""
    if picked is not None:
        return picked, token_log_prob(logits, picked, temperature) if with_log_prob else None
    if not with_log_prob:
        return sample_next(logits, temperature, top_k, top_p, generator), None
    return sample_with_log_prob(logits, temperature, top_k, top_p, generator)


STOP_CHECK_EVERY = 8
"""Decode steps between two checks for every row having stopped. A check reads a flag back
from the device (and in lockstep all-reduces it); rows that stop in between run up to this
many steps more, whose tokens are padded over, so the result is the same."""


def _all_stopped(
    tokens: torch.Tensor, step: int, stop: torch.Tensor, group: ProcessGroup | None
) -> bool:
    """Every row of this rank (with ``group``: of every rank in it) holds a stop token in its
    first ``step + 1`` columns; checked every ``STOP_CHECK_EVERY`` steps, and never without
    stop tokens (every rank then runs all the steps)."""
    if stop.numel() == 0 or (step + 1) % STOP_CHECK_EVERY:
        return False
    done = torch.isin(tokens[:, : step + 1], stop).any(dim=1).all()
    if group is None:
        return bool(done)
    flag = done.to(torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag)


def _cut_at_stops(
    tokens: torch.Tensor, log_probs: torch.Tensor | None, stop: torch.Tensor, pad_id: int
) -> torch.Tensor:
    """Pad over (in place) what each row of ``tokens`` [b, n] decoded after its first stop
    token, zero those log-probs, and return the rows' lengths [b], stop token included."""
    hits = torch.isin(tokens, stop)
    after = (hits.cumsum(dim=1) - hits.long()) > 0
    tokens.masked_fill_(after, pad_id)
    if log_probs is not None:
        log_probs[:, : tokens.shape[1]].masked_fill_(after, 0.0)
    return tokens.shape[1] - after.sum(dim=1)


STATIC_LENGTH_STEP = 64
"""A static cache's length is rounded up to a multiple of this, so prompts of different
widths share a compiled step."""


def decode_step(
    model: nn.Module, token: torch.Tensor, positions: torch.Tensor, cache: KVCache, greedy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decoding step: tokens [b, 1] at positions [b, 1] -> next-token logits [b, vocab]
    in fp32 and, when ``greedy``, their argmax [b] (inside the compiled graph, where it is
    fused; a sample needs the caller's generator, so it is drawn outside), the cache
    advanced by a column."""
    logits = model(token, positions, cache=cache)[:, -1].float()
    return logits, greedy_pick(logits) if greedy else None


_COMPILED: list[Callable[..., tuple[torch.Tensor, torch.Tensor | None]]] = []


def compiled_decode_step() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """``decode_step`` under ``torch.compile`` with static shapes, built on first use and
    shared (a new model, batch size or cache length adds a graph to it)."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(decode_step, dynamic=False))
    return _COMPILED[0]


def left_pad(prompts: Prompts, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [b, s] with each prompt ending at the last column, and the mask of real
    tokens [b, s]. A tensor [b, s] is taken as b prompts of s tokens. Padding holds id 0, a
    valid embedding index whose output attention hides."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2 or prompts.shape[1] == 0:
            raise ValueError(
                f"input_ids must be [batch, seq] with seq >= 1, got {list(prompts.shape)}"
            )
        return prompts.to(device), torch.ones(prompts.shape, dtype=torch.bool, device=device)
    rows = [torch.as_tensor(p, dtype=torch.long) for p in prompts]
    if not rows or any(r.dim() != 1 or r.numel() == 0 for r in rows):
        raise ValueError("input_ids must be a non-empty list of non-empty 1-D token id lists")
    width = max(r.numel() for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, width - row.numel() :] = row
        valid[i, width - row.numel() :] = True
    return ids.to(device), valid.to(device)
