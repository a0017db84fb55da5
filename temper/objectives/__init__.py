"""Training objectives behind one interface: `loss(model, batch) -> (sum, n_tokens, metrics)`."""

from temper.objectives.causal_lm import IGNORE_INDEX, CausalLM, Objective, count_tokens
from temper.objectives.dpo import DPO
from temper.objectives.registry import build_objective, objective_names, register_objective

__all__ = [
    "DPO",
    "IGNORE_INDEX",
    "CausalLM",
    "Objective",
    "build_objective",
    "count_tokens",
    "objective_names",
    "register_objective",
]
