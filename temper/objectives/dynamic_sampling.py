"""DAPO's dynamic sampling: a rollout keeps only groups whose rewards differ, drawing more
prompts until it has as many groups as it was given.

A group whose completions all score alike has advantage 0 on every token: it costs a
training forward and teaches nothing, and a batch full of them shrinks the effective batch
size. ``fill_rollout`` samples the given prompts, drops those groups, and samples further
micro-batches of prompts from the loader until the informative groups fill the batch or
``draws`` micro-batches were sampled; a batch still short is topped up with dropped groups
(advantage 0) so that every rollout micro-batch has its usual number of rows.

Deterministic and resumable: the extra prompts come from the (checkpointed) loader in its
order, and draw ``d`` samples with the generator the trainer seeds for it. Under data
parallelism every rank draws as many micro-batches as the rank that needs the most (one
all-reduce per draw), so ranks run the same number of forwards (and FSDP all-gathers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from temper.data.batch import IGNORE_INDEX, Batch, pad_tokens
from temper.objectives.rollout import RolloutSettings

Rollout = tuple[Batch, dict[str, float]]


@runtime_checkable
class DynamicSampling(Protocol):
    """A rollout objective that can refill its batch: its ``settings``' ``sampling_draws``
    prompt micro-batches at most per rollout micro-batch (1 = off), groups of ``group_size``
    rows."""

    settings: RolloutSettings


def fill_rollout(
    sample: Callable[[Batch, torch.Generator], Rollout],
    prompts: Batch,
    more_prompts: Callable[[], Batch],
    sampler: Callable[[int], torch.Generator],
    group_size: int,
    draws: int,
) -> Rollout:
    """The rollout of ``prompts`` (``sample(prompts, sampler(0))``) with its uninformative
    groups replaced by informative ones from up to ``draws - 1`` further micro-batches
    (``more_prompts()``, sampled with ``sampler(d)``). Metrics are the mean over every draw
    (the maximum for ``*_max``), plus ``sampling_draws``."""
    target = prompts["prompt_ids"].shape[0]
    kept: list[Batch] = []
    spare: list[Batch] = []
    results: list[dict[str, float]] = []
    for draw in range(draws):
        if draw and not _anyone_short(len(kept) < target, prompts["prompt_ids"].device):
            break
        batch, metrics = sample(prompts if draw == 0 else more_prompts(), sampler(draw))
        results.append(metrics)
        for group in _groups(batch, group_size):
            (kept if group["advantages"].abs().amax() > 0 else spare).append(group)
    metrics = {
        name: max(m[name] for m in results)
        if name.endswith("_max")
        else sum(m[name] for m in results) / len(results)
        for name in results[0]
    }
    return _concat((kept + spare)[:target]), metrics | {"sampling_draws": float(len(results))}


def _anyone_short(short: bool, device: torch.device) -> bool:
    """Whether any data-parallel rank still lacks informative groups (every rank calls it)."""
    flag = torch.tensor(float(short), device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _groups(batch: Batch, group_size: int) -> list[Batch]:
    """The batch cut into its prompts' groups of consecutive rows."""
    rows = batch["advantages"].shape[0]
    return [
        {key: value[start : start + group_size] for key, value in batch.items()}
        for start in range(0, rows, group_size)
    ]


def _concat(groups: list[Batch]) -> Batch:
    """Groups from rollouts of different widths as one batch: per-token tensors [b, s] are
    right-padded to the widest (labels with IGNORE_INDEX, so padding never trains)."""
    batch = {}
    for key in groups[0]:
        parts = [group[key] for group in groups]
        if parts[0].dim() >= 2:
            width = max(p.shape[1] for p in parts)
            fill = IGNORE_INDEX if key == "labels" else 0
            parts = [pad_tokens(p, width - p.shape[1], fill) for p in parts]
        batch[key] = torch.cat(parts)
    return batch
