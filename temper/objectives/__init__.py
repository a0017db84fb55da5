"""Training objectives behind one interface: `loss(model, batch) -> (sum, n_tokens, metrics)`;
RL objectives also `prepare` their batch (rollouts, rewards, advantages) first."""

from temper.objectives.causal_lm import IGNORE_INDEX, CausalLM, Objective, count_tokens
from temper.objectives.dpo import DPO
from temper.objectives.grpo import GRPO
from temper.objectives.registry import build_objective, objective_names, register_objective
from temper.objectives.rewards import register_reward, reward_names

__all__ = [
    "DPO",
    "IGNORE_INDEX",
    "GRPO",
    "CausalLM",
    "Objective",
    "build_objective",
    "count_tokens",
    "objective_names",
    "register_objective",
    "register_reward",
    "reward_names",
]
