"""The policy-gradient losses GRPO can train with, chosen by ``--objective.loss``.

All of them weigh the sampled tokens by group-relative advantages and hold the update near
the sampling policy with a clipped importance ratio; they differ in what the ratio is taken
over and what the sum is divided by:

- ``grpo``: per-token ratio ``exp(logp - old)``, advantages ``(r - mean) / (std + eps)``,
  the sum over completion tokens divided by their number over the whole step (DAPO's
  token-level normalization: a long completion weighs by its length).
- ``gspo`` (Zheng et al., 2025): one ratio per completion, ``exp(mean_t(logp - old))`` (the
  geometric mean of its tokens' ratios), clipped per completion; each completion's loss is
  its own, and the step divides by the number of completions.
- ``dr_grpo`` (Liu et al., 2025, "Dr. GRPO"): advantages ``r - mean`` (no std division,
  which favours groups with little spread), the token sum divided by a constant, rows times
  ``max_new_tokens``, not by the tokens the completions happen to have (so length carries no
  bias).

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

LossName = Literal["grpo", "gspo", "dr_grpo"]

ADVANTAGE_EPS = 1e-4
"""Added to a group's reward std: a group whose rewards all agree gets advantage 0."""


@dataclass(frozen=True)
class PolicyLoss:
    """One choice of ``objective.loss`` with its clip range and importance-sampling cap."""

    name: LossName = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    tis_cap: float | None = None
    max_new_tokens: int = 1
    """Dr. GRPO's constant normalizer is rows x this."""
    mask_band: tuple[float, float] | None = None
    """Tokens whose exp(old - sampler) leaves [low, high] get no loss (None = off)."""

    def advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """Group-relative advantages of the rewards: over the group's std unless ``dr_grpo``."""
        return group_advantages(rewards, group_size, scale=self.name != "dr_grpo")

    def count(self, completion: torch.Tensor) -> torch.Tensor:
        """The units the loss sums over, for completion masks [b, s]: tokens, completions
        (``gspo``) or rows x ``max_new_tokens`` (``dr_grpo``)."""
        if self.name == "gspo":
            return completion.any(dim=1).sum()
        if self.name == "dr_grpo":
            return torch.tensor(completion.shape[0] * self.max_new_tokens, device=completion.device)
        return completion.sum()

    def reduce(self, per_token: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
        """Sum a per-token quantity [b, s] in the loss's unit: over completion tokens, or over
        completions of each one's token mean (``gspo``)."""
        per_token = per_token.masked_fill(~completion, 0.0)
        if self.name == "gspo":
            return (per_token.sum(dim=1) / completion.sum(dim=1).clamp(min=1)).sum()
        return per_token.sum()

    def __call__(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        completion: torch.Tensor,
        sampler_log_probs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Metrics]:
        """The summed policy loss for per-token log-probs [b, s] (old and, with ``tis_cap``,
        the sampler's) and per-row advantages [b], and its metrics: ``clip_fraction``, the
        share of units (tokens; completions for ``gspo``) whose clipped term decided (no
        gradient)."""
        delta = (log_probs - old_log_probs).masked_fill(~completion, 0.0)
        if self.name == "gspo":
            n = completion.sum(dim=1).clamp(min=1)
            ratio = torch.exp(delta.sum(dim=1) / n)  # [b]
            adv, units = advantages, completion.any(dim=1)
        else:
            ratio, adv, units = torch.exp(delta), advantages[:, None], completion
        loss, decided = clipped_loss(ratio, adv, self.clip_low, self.clip_high)
        if self.tis_cap is not None:
            loss = loss * self._tis_weights(old_log_probs, sampler_log_probs, completion)
        metrics = {"clip_fraction": (decided & units).sum() / units.sum().clamp(min=1)}
        if self.mask_band is not None:
            kept = self._band_mask(old_log_probs, sampler_log_probs, completion)
            metrics["masked_fraction"] = 1 - (kept & units).sum() / units.sum().clamp(min=1)
            loss = loss.masked_fill(~kept, 0.0)
        return loss.masked_fill(~units, 0.0).sum(), metrics

    def _band_mask(
        self, old: torch.Tensor, sampler: torch.Tensor | None, completion: torch.Tensor
    ) -> torch.Tensor:
        """Where ``exp(old - sampler)`` lies in ``mask_band``, per token [b, s] (per completion
        [b] for ``gspo``, from the mean log difference)."""
        if sampler is None:
            raise ValueError("objective.mask_band needs the sampler's log-probs in the batch")
        gap = (old - sampler).masked_fill(~completion, 0.0)
        if self.name == "gspo":
            gap = gap.sum(dim=1) / completion.sum(dim=1).clamp(min=1)
        low, high = self.mask_band
        ratio = torch.exp(gap)
        return (ratio >= low) & (ratio <= high)

    def _tis_weights(
        self, old: torch.Tensor, sampler: torch.Tensor | None, completion: torch.Tensor
    ) -> torch.Tensor:
        """``min(exp(old - sampler), tis_cap)`` per token [b, s] (per completion [b] for
        ``gspo``, from the mean log difference)."""
        if sampler is None:
            raise ValueError("objective.tis_cap needs the sampler's log-probs in the batch")
        gap = (old - sampler).masked_fill(~completion, 0.0)
        if self.name == "gspo":
            gap = gap.sum(dim=1) / completion.sum(dim=1).clamp(min=1)
        return torch.exp(gap).clamp(max=self.tis_cap)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True) -> torch.Tensor:
    """rewards [prompts * group_size], grouped consecutively -> advantages of the same shape:
    each reward minus its group's mean, over the group's (unbiased) std when ``scale``."""
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (groups.std(dim=1, keepdim=True) + ADVANTAGE_EPS)
    return centred.view(-1)


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
