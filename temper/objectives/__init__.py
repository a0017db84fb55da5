"""Training objectives behind one interface: `loss(model, batch) -> (sum, count, metrics)`;
rollout objectives (RL) also `prepare` their batch (rollouts, rewards, advantages) first.
Importing this package registers the built-in ones; each keeps its typed config section
beside its loss."""

from temper.objectives.causal_lm import CausalLM, CausalLMConfig, count_tokens
from temper.objectives.dpo import DPO, DPOConfig
from temper.objectives.grpo import GRPO, GRPOConfig
from temper.objectives.registry import (
    Metrics,
    Objective,
    RolloutObjective,
    build_objective,
    objective_names,
    register_objective,
)
from temper.objectives.rewards import register_reward, reward_names

__all__ = [
    "DPO",
    "GRPO",
    "CausalLM",
    "CausalLMConfig",
    "DPOConfig",
    "GRPOConfig",
    "Metrics",
    "Objective",
    "RolloutObjective",
    "build_objective",
    "count_tokens",
    "objective_names",
    "register_objective",
    "register_reward",
    "reward_names",
]
