"""The policy-gradient losses GRPO can train with, chosen by ``--objective.loss``, named as
the papers and TRL's ``GRPOConfig.loss_type`` name them.

All of them weigh the sampled tokens by group-relative advantages and hold the update near
the sampling policy with a clipped importance ratio; they differ in what the ratio is taken
over and what the sum of the per-token losses is divided by:

- ``grpo`` (Shao et al., 2024, DeepSeekMath): per-token ratio ``exp(logp - old)``; each
  completion's loss is the mean over its tokens, and the step averages completions.
- ``dapo`` (Yu et al., 2025): per-token ratio; the sum over every completion token of the
  step divided by their number (all micro-batches, all ranks): a long completion weighs by
  its length. TRL's default.
- ``bnpo``: per-token ratio; each micro-batch's token sum over that micro-batch's completion
  tokens, then the mean over micro-batches and ranks (TRL's "local batch").
- ``dr_grpo`` (Liu et al., 2025, "Dr. GRPO"): per-token ratio; the token sum divided by a
  constant, rows times ``max_new_tokens``, so length carries no bias. The paper also drops the
  std division of the advantages: ``advantage_scale none``.
- ``gspo`` (Zheng et al., 2025): one ratio per completion, ``exp(mean_t(logp - old))`` (the
  geometric mean of its tokens' ratios), clipped per completion; averaged over completions as
  ``grpo`` (TRL: ``importance_sampling_level="sequence"`` with ``loss_type="grpo"``).

Advantages are ``r - mean_group``, divided by ``std + eps`` of the group (``group``), of
every reward of the step (``batch``: all micro-batches on all data ranks, divided once the
step's rollout is drawn, ``batch_std``), or not at all (``none``). A per-token term added to
the loss (the KL) is divided like the policy term, as TRL adds it before normalizing.

The clip range is asymmetric, ``[1 - clip_low, 1 + clip_high]`` (DAPO's clip-higher leaves
low-probability tokens more room to grow). Truncated importance sampling (``tis_cap``,
Yao et al., 2025) corrects for a sampler whose numerics differ from the trainer's: each
token's loss is weighed by ``min(exp(old - sampler), tis_cap)``, the trainer's old
log-prob against the sampler's own (per completion, from their mean difference, for
``gspo``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from temper.objectives.registry import Metrics

LossName = Literal["grpo", "dapo", "bnpo", "dr_grpo", "gspo"]
AdvantageScale = Literal["group", "batch", "none"]

ADVANTAGE_EPS = 1e-4
"""Added to the reward std: a group whose rewards all agree gets advantage 0."""

PER_COMPLETION: tuple[LossName, ...] = ("grpo", "gspo")
"""The losses that average each completion over its own tokens."""


@dataclass(frozen=True)
class PolicyLoss:
    """One choice of ``objective.loss`` with its clip range and importance-sampling cap."""

    name: LossName = "dapo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    tis_cap: float | None = None
    max_new_tokens: int = 1
    """Dr. GRPO's constant normalizer is rows x this."""
    mask_band: tuple[float, float] | None = None
    """Tokens whose exp(old - sampler) leaves [low, high] get no loss (None = off)."""
    scale: AdvantageScale = "group"
    """What the centred rewards are divided by the std of (``none``: nothing)."""

    def advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """Group-relative advantages of the rewards, over the group's std with ``group``
        (``batch``: still to be divided by ``batch_std`` of the whole step)."""
        return group_advantages(rewards, group_size, scale=self.scale == "group")

    def count(self, completion: torch.Tensor, whole: bool = True) -> torch.Tensor:
        """The units the step's loss is divided by, for completion masks [b, s]: tokens
        (``dapo``), completions (``grpo``, ``gspo``), micro-batches (``bnpo``) or rows x
        ``max_new_tokens`` (``dr_grpo``). ``whole``: False on every sequence-parallel slice
        but the first, which alone counts the rows (a token count adds up over slices)."""
        if self.name == "dapo":
            return completion.sum()
        rows = completion.shape[0]
        units = {"bnpo": 1, "dr_grpo": rows * self.max_new_tokens}.get(self.name, rows)
        return torch.tensor(units if whole else 0, device=completion.device)

    def reduce(
        self, per_token: torch.Tensor, completion: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """Sum a per-token quantity [b, s] in the loss's unit: each completion's token sum
        over its length ``lengths`` [b] (whole rows: under sequence parallelism ``per_token``
        is a slice), the token sum over the micro-batch's tokens (``bnpo``), or the token sum."""
        total = per_token.masked_fill(~completion, 0.0)
        if self.name in PER_COMPLETION:
            return (total.sum(dim=1) / lengths.clamp(min=1)).sum()
        if self.name == "bnpo":
            return total.sum() / lengths.sum().clamp(min=1)
        return total.sum()

    def __call__(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        completion: torch.Tensor,
        sampler_log_probs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
        """The per-token policy loss [b, s] (0 off the completions) for per-token log-probs
        [b, s] (old and, with ``tis_cap``, the sampler's) and per-row advantages [b]; the
        importance ratio ([b, s], or [b, 1] for ``gspo``); and the metrics:
        ``clip_fraction``, the share of units (tokens; completions for ``gspo``) whose clipped
        term decided (no gradient)."""
        delta = (log_probs - old_log_probs).masked_fill(~completion, 0.0)
        if self.name == "gspo":
            n = completion.sum(dim=1, keepdim=True).clamp(min=1)
            ratio = torch.exp(delta.sum(dim=1, keepdim=True) / n)  # [b, 1]
            units = completion.any(dim=1, keepdim=True)
        else:
            ratio, units = torch.exp(delta), completion
        loss, decided = clipped_loss(ratio, advantages[:, None], self.clip_low, self.clip_high)
        if self.tis_cap is not None:
            loss = loss * self._tis_weights(old_log_probs, sampler_log_probs, completion)
        metrics = {"clip_fraction": (decided & units).sum() / units.sum().clamp(min=1)}
        if self.mask_band is not None:
            kept = self._band_mask(old_log_probs, sampler_log_probs, completion)
            metrics["masked_fraction"] = 1 - (kept & units).sum() / units.sum().clamp(min=1)
            loss = loss.masked_fill(~kept, 0.0)
        return loss.expand_as(completion).masked_fill(~completion, 0.0), ratio, metrics

    def _band_mask(
        self, old: torch.Tensor, sampler: torch.Tensor | None, completion: torch.Tensor
    ) -> torch.Tensor:
        """Where ``exp(old - sampler)`` lies in ``mask_band``, per token [b, s] (per completion
        [b, 1] for ``gspo``, from the mean log difference)."""
        if sampler is None:
            raise ValueError("objective.mask_band needs the sampler's log-probs in the batch")
        low, high = self.mask_band
        ratio = torch.exp(self._sampler_gap(old, sampler, completion))
        return (ratio >= low) & (ratio <= high)

    def _tis_weights(
        self, old: torch.Tensor, sampler: torch.Tensor | None, completion: torch.Tensor
    ) -> torch.Tensor:
        """``min(exp(old - sampler), tis_cap)`` per token [b, s] (per completion [b, 1] for
        ``gspo``, from the mean log difference)."""
        if sampler is None:
            raise ValueError("objective.tis_cap needs the sampler's log-probs in the batch")
        return torch.exp(self._sampler_gap(old, sampler, completion)).clamp(max=self.tis_cap)

    def _sampler_gap(
        self, old: torch.Tensor, sampler: torch.Tensor, completion: torch.Tensor
    ) -> torch.Tensor:
        """``old - sampler`` per token, or its mean per completion [b, 1] for ``gspo``."""
        gap = (old - sampler).masked_fill(~completion, 0.0)
        if self.name == "gspo":
            return gap.sum(dim=1, keepdim=True) / completion.sum(dim=1, keepdim=True).clamp(min=1)
        return gap


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True) -> torch.Tensor:
    """rewards [prompts * group_size], grouped consecutively -> advantages of the same shape:
    each reward minus its group's mean, over the group's (unbiased) std + ``ADVANTAGE_EPS``
    when ``scale``."""
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (groups.std(dim=1, keepdim=True) + ADVANTAGE_EPS)
    return centred.view(-1)


def batch_std(sums: torch.Tensor) -> torch.Tensor:
    """The unbiased std of rewards from their sums (count, sum, sum of squares) over the whole
    step, 0 for a single reward, as TRL's ``scale_rewards="batch"`` takes it; the centred
    advantages are divided by it + ``ADVANTAGE_EPS``."""
    n, total, squares = sums.double().unbind()
    if n <= 1:
        return torch.zeros((), dtype=torch.float64, device=sums.device)
    return ((squares - total * total / n).clamp(min=0) / (n - 1)).sqrt()


def clipped_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic term ``-min(ratio A, clip(ratio, 1 - low, 1 + high) A)``, and where
    the clipped term decided it (it was smaller, so that unit gives no gradient)."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def overlong_penalty(
    lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to each completion's reward: 0 up to
    ``max_new_tokens - buffer`` tokens, then falling linearly to ``-penalty`` at
    ``max_new_tokens`` (where an unfinished completion was cut)."""
    start = max_new_tokens - buffer
    over = (lengths.float() - start).clamp(min=0) / buffer
    return -penalty * over.clamp(max=1)
