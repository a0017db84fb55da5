"""Preference objectives on pairs: DPO (Rafailov et al., 2023) and its variants.

Per pair, with the answers' summed log-probabilities under the policy (``pi``) and the frozen
reference (``ref``), their token counts ``n``, the log-ratios ``r = pi - ref`` and
``h = r_c - r_r`` (``c`` chosen, ``r`` rejected), and the policy's per-token average
``a = pi / n``:

- sigmoid (DPO, TRL's ``sigmoid``): ``-log sigmoid(beta h)``;
- cdpo (conservative DPO, Mitchell 2023): ``-(1 - eps) log sigmoid(beta h) - eps log
  sigmoid(-beta h)``, ``eps`` = ``label_smoothing``, the chance that a label is flipped;
- ipo (Azar et al., 2023, as the paper writes it): ``(h - 1 / (2 beta))^2``;
- ipo_norm (TRL's ``ipo``): the same with each log-ratio averaged over its answer's tokens,
  ``h = r_c / n_c - r_r / n_r``;
- rpo (Pang et al., 2024): sigmoid plus ``alpha`` times the chosen answer's NLL per token,
  ``-a_c``;
- simpo (Meng et al., 2024; no reference): ``-log sigmoid(beta (a_c - a_r) - gamma)``;
- orpo (Hong et al., 2024; no reference): ``-a_c - beta log sigmoid(log odds)``, with
  ``log odds = (a_c - log(1 - e^a_c)) - (a_r - log(1 - e^a_r))`` (``beta`` is the paper's
  lambda).

The loss is per pair, so ``count`` is the number of pairs and the trainer's division makes
it the mean over the step's pairs. A model whose sparse-attention indexers train (DeepSeek
V3.2, GLM-5) adds ``indexer_loss_weight * kl`` per pair (``indexer_term``), the KL of the
policy forward on both answers. The implicit rewards, ``beta r`` (``beta a`` without a
reference), give the metrics: chosen and rejected rewards, their margin, and how often
chosen wins.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.distributed as dist
import torch.distributed.nn as dist_nn
import torch.nn.functional as F
from torch import nn

from temper.config import (
    Config,
    ConfigError,
    Kernels,
    ObjectiveConfig,
    check_positive,
    check_range,
)
from temper.data.batch import IGNORE_INDEX, SEQUENCE_SHARD, Batch, SequenceShard
from temper.objectives.causal_lm import label_log_probs
from temper.objectives.model_terms import indexer_term
from temper.objectives.registry import (
    Metrics,
    Objective,
    ReferenceMode,
    reference_policy,
    register_objective,
)

LossType = Literal["sigmoid", "cdpo", "ipo", "ipo_norm", "rpo", "simpo", "orpo"]

Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, SequenceShard | None]
"""(input ids, labels, position ids, SP shard) of the chosen rows then the rejected ones."""

REFERENCE_FREE: frozenset[str] = frozenset({"simpo", "orpo"})
"""Loss types that compare the policy with itself: no reference model is built or run."""


@register_objective
@dataclass
class DPOConfig(ObjectiveConfig):
    """``--objective.*`` of DPO and its variants on preference pairs (see the module
    docstring for each loss)."""

    name: str = "dpo"
    """Training objective, as registered with `temper.objectives.register_objective`."""
    beta: float = 0.1
    """Strength of the pull toward the reference (the KL coefficient); simpo: the reward
    scale; orpo: lambda, the weight of the odds-ratio term."""
    label_smoothing: float = 0.0
    """cdpo only: assumed probability that a preference label is flipped."""
    loss_type: LossType = "sigmoid"
    """sigmoid (DPO), cdpo (label-smoothed DPO), ipo (summed log-ratios), ipo_norm (per-token
    log-ratios, TRL's ipo), rpo (DPO + NLL), simpo or orpo (no reference)."""
    simpo_gamma: float = 0.5
    """simpo: the target reward margin gamma."""
    rpo_alpha: float = 1.0
    """rpo: the weight of the chosen answer's per-token NLL."""

    data_formats: ClassVar[tuple[str, ...]] = ("preference",)

    def validate(self, config: Config) -> None:
        check_positive(config, "objective.beta")
        check_range(config, "objective.label_smoothing", 0.0, 0.5)
        if self.label_smoothing and self.loss_type != "cdpo":
            raise ConfigError(
                f"objective.label_smoothing applies to objective.loss_type 'cdpo' (conservative "
                f"DPO), not {self.loss_type!r}; TRL's sigmoid ignores it"
            )

    def build(self, config: Config, build_reference: Callable[[], nn.Module]) -> Objective:
        references = {}
        if self.loss_type not in REFERENCE_FREE:
            references = reference_policy(config, build_reference)
        return DPO(self, kernels=config.kernels, **references)


def sequence_log_probs(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    shard: SequenceShard | None = None,
    kernels: Kernels | None = None,
) -> torch.Tensor:
    """Sum over each row of the log-probabilities of its labels (ignored ones count 0). With
    a sequence-parallel ``shard`` the slices' sums are added over the SP group (its backward
    sums each rank's gradient), so every SP rank holds the whole rows' sums. ``kernels``: as
    ``label_log_probs`` takes them."""
    log_probs = label_log_probs(
        model, input_ids, labels, position_ids, shard=shard, kernels=kernels
    )
    sums = log_probs.sum(dim=-1)
    if shard is not None and shard.group is not None:
        sums = dist_nn.all_reduce(sums, group=shard.group)
    return sums


def answer_tokens(labels: torch.Tensor, shard: SequenceShard | None = None) -> torch.Tensor:
    """Trained labels of each row, as a float for the length-normalized losses; under sequence
    parallelism the slices' counts are added over the SP group, like ``sequence_log_probs``."""
    tokens = (labels != IGNORE_INDEX).sum(dim=-1).float()
    if shard is not None and shard.group is not None:
        dist.all_reduce(tokens, group=shard.group)
    return tokens


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - e^x)`` for ``x < 0``, accurate near 0 (expm1) and far below it (log1p). Each
    branch sees only its own side of the switch, so the one not taken has a finite gradient
    (``where`` multiplies it by 0, and 0 * inf would be NaN)."""
    switch = -math.log(2)
    near = torch.log(-torch.expm1(x.clamp(min=switch)))
    far = torch.log1p(-torch.exp(x.clamp(max=switch)))
    return torch.where(x > switch, near, far)


def preference_loss(
    policy: torch.Tensor,
    reference: torch.Tensor | None,
    tokens: torch.Tensor,
    *,
    beta: float,
    loss_type: LossType = "sigmoid",
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    rpo_alpha: float = 1.0,
) -> torch.Tensor:
    """Per-pair losses (see the module docstring) from rows of chosen answers then rejected
    ones: summed log-probabilities under the ``policy`` and the ``reference`` (None for a
    reference-free loss) and answer lengths ``tokens``."""
    if label_smoothing and loss_type != "cdpo":
        raise ValueError(f"label_smoothing applies to loss_type 'cdpo', not {loss_type!r}")
    n = policy.shape[0] // 2
    average = policy / tokens.clamp(min=1)
    if loss_type == "simpo":
        return -F.logsigmoid(beta * (average[:n] - average[n:]) - simpo_gamma)
    if loss_type == "orpo":
        odds = average - _log1mexp(average)
        return -average[:n] - beta * F.logsigmoid(odds[:n] - odds[n:])
    ratio = policy - reference
    if loss_type == "ipo_norm":
        ratio = ratio / tokens.clamp(min=1)
    h = ratio[:n] - ratio[n:]
    if loss_type in ("ipo", "ipo_norm"):
        return (h - 1 / (2 * beta)) ** 2
    losses = -(1 - label_smoothing) * F.logsigmoid(beta * h)
    losses = losses - label_smoothing * F.logsigmoid(-beta * h)
    if loss_type == "rpo":
        return losses - rpo_alpha * average[:n]
    return losses


class DPO:
    """A preference loss against a reference: a frozen model, or the policy inside
    ``reference_mode`` (the base with LoRA adapters off) when ``reference`` is None; the
    reference-free losses (simpo, orpo) take neither and run no reference forward."""

    def __init__(
        self,
        settings: DPOConfig,
        *,
        reference: nn.Module | None = None,
        reference_mode: ReferenceMode | None = None,
        kernels: Kernels | None = None,
    ) -> None:
        """``kernels``: the run's choices for the head (None: the references, full
        logits)."""
        needed = 0 if settings.loss_type in REFERENCE_FREE else 1
        if (reference is not None) + (reference_mode is not None) != needed:
            wanted = "exactly one of a reference model or a reference mode" if needed else "none"
            raise ValueError(f"loss_type {settings.loss_type!r} takes {wanted}")
        self.settings = settings
        self.reference = reference
        self.reference_mode = reference_mode
        self.kernels = kernels

    def count(self, batch: Batch) -> torch.Tensor:
        """Pairs: the unit the loss is averaged over."""
        return torch.tensor(batch["chosen_input_ids"].shape[0])

    def _reference_log_probs(self, model: nn.Module, rows: Rows) -> torch.Tensor | None:
        if self.settings.loss_type in REFERENCE_FREE:
            return None
        with torch.no_grad():
            if self.reference is not None:
                return sequence_log_probs(self.reference, *rows, self.kernels)
            with self.reference_mode(model):
                return sequence_log_probs(model, *rows, self.kernels)

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
        input_ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
        labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
        n = batch["chosen_input_ids"].shape[0]
        # Under SP: both sides are sliced alike (rows of one width), positions are global.
        shard = batch.get(f"chosen_{SEQUENCE_SHARD}")
        positions = None
        if "chosen_position_ids" in batch:
            positions = torch.cat([batch["chosen_position_ids"], batch["rejected_position_ids"]])
        rows = (input_ids, labels, positions, shard)
        policy = sequence_log_probs(model, *rows, self.kernels)
        metrics: Metrics = {}
        # Read before the reference forward, which clears it when it is the policy's own.
        indexer = indexer_term(model, self.count(batch), metrics)
        ref = self._reference_log_probs(model, rows)
        tokens = answer_tokens(labels, shard)
        settings = self.settings
        losses = preference_loss(
            policy,
            ref,
            tokens,
            beta=settings.beta,
            loss_type=settings.loss_type,
            label_smoothing=settings.label_smoothing,
            simpo_gamma=settings.simpo_gamma,
            rpo_alpha=settings.rpo_alpha,
        )
        implicit = policy / tokens.clamp(min=1) if ref is None else policy - ref
        rewards = settings.beta * implicit.detach()
        chosen, rejected = rewards[:n], rewards[n:]
        metrics |= {
            "rewards_chosen": chosen.mean(),
            "rewards_rejected": rejected.mean(),
            "reward_margin": (chosen - rejected).mean(),
            "reward_accuracy": (chosen > rejected).float().mean(),
        }
        return losses.sum() + indexer, self.count(batch), metrics
