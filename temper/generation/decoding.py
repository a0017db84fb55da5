"""Decoding with the training model itself: prefill the prompts, then one token per step."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from temper.generation.fsdp import gathered_weights
from temper.generation.sampling import check_sampling, sample_next
from temper.models.layers.kv_cache import KVCache

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
) -> Generation:
    """Up to ``max_new_tokens`` new tokens after each prompt, with a KV cache.

    Prompts are left-padded; each row's positions start at 0 at its first real token and
    attention never sees the padding, so a row decodes as it would alone. Temperature 0 is
    greedy; see ``sample_next`` for the rest. A row stops after any of ``stop_tokens``; its
    later columns hold ``pad_id`` (any int: it is never fed to the model). Under FSDP2 the
    weights are gathered once for the whole call (``gathered_weights``). With
    ``lockstep_group`` (expert parallelism: each token's forward is an all-to-all) every rank
    of the group decodes until all of them are done, one all-reduce of a done flag per step;
    a rank whose rows all stopped keeps running padded steps.
    """
    check_sampling(temperature, top_k, top_p)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    ids, valid = left_pad(input_ids, device)
    batch = ids.shape[0]
    positions = (valid.cumsum(dim=1) - 1).clamp(min=0)
    # The last new token is returned, never fed back: it needs no column.
    cache = KVCache(
        torch.cat([valid, valid.new_ones(batch, max_new_tokens - 1)], 1), len(model.layers)
    )
    stop = torch.tensor(sorted(stop_tokens), dtype=torch.long, device=device)
    tokens = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
    log_probs = torch.zeros(batch, max_new_tokens, device=device) if return_log_probs else None
    lengths = torch.full((batch,), max_new_tokens, dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    with gathered_weights(model):
        logits = model(ids, positions, cache=cache)[:, -1].float()
        for step in range(max_new_tokens):
            # A finished row still runs (the batch moves together) on what it samples; its
            # output is padded over, so pad_id never reaches the model and needs no embedding.
            token = sample_next(logits, temperature, top_k, top_p, generator)
            tokens[:, step] = token.masked_fill(done, pad_id)
            if log_probs is not None:
                scaled = logits / temperature if temperature > 0 else logits
                picked = scaled.log_softmax(dim=-1).gather(1, token[:, None]).squeeze(1)
                log_probs[:, step] = picked.masked_fill(done, 0.0)
            stopped = ~done & torch.isin(token, stop)
            lengths = lengths.masked_fill(stopped, step + 1)
            done |= stopped
            if step == max_new_tokens - 1 or _all_done(done, lockstep_group):
                break
            positions = positions[:, -1:] + 1
            logits = model(token[:, None], positions, cache=cache)[:, -1].float()
    return Generation(tokens, lengths, log_probs)


def _all_done(done: torch.Tensor, group: ProcessGroup | None) -> bool:
    """Every row of this rank done, and with ``group`` every row of every rank in it."""
    if group is None:
        return bool(done.all())
    flag = done.all().to(torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag)


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
