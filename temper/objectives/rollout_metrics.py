"""What a rollout says about the learning signal it carries, beside its rewards: how many
groups teach nothing, and how far the sampler's numerics are from the trainer's."""

from __future__ import annotations

import torch


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[prompts] True where a group's rewards differ: a group whose rewards all agree has
    advantage 0 everywhere and gives no gradient."""
    groups = rewards.view(-1, group_size)
    return groups.amax(dim=1) > groups.amin(dim=1)


def rollout_signal_metrics(
    rewards: torch.Tensor,
    group_size: int,
    sampler_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    completion: torch.Tensor,
) -> dict[str, float]:
    """``no_signal_groups`` (the share of groups whose rewards all agree) and
    ``logprob_diff_mean`` (the mean absolute sampler-trainer log-prob gap per completion
    token; ``logprob_diff_max`` is its largest)."""
    gap = (sampler_log_probs - old_log_probs)[completion].abs()
    return {
        "no_signal_groups": 1.0 - informative_groups(rewards, group_size).float().mean().item(),
        "logprob_diff_mean": gap.mean().item() if gap.numel() else 0.0,
    }
