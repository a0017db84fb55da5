"""What a rollout says about the learning signal it carries, beside its rewards: how many
groups teach nothing. (How far the sampler's numerics are from the trainer's, the loss
reports: ``logprob_diff_mean``/``_max`` in ``temper.objectives.grpo``.)"""

from __future__ import annotations

import torch


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[prompts] True where a group's rewards differ: a group whose rewards all agree has
    advantage 0 everywhere and gives no gradient."""
    groups = rewards.view(-1, group_size)
    return groups.amax(dim=1) > groups.amin(dim=1)


def no_signal_groups(rewards: torch.Tensor, group_size: int) -> float:
    """The share of groups whose rewards all agree."""
    return 1.0 - informative_groups(rewards, group_size).float().mean().item()
