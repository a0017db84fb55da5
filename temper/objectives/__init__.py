"""Training objectives behind one interface: `loss(model, batch) -> (sum, n_tokens, metrics)`."""

from temper.objectives.causal_lm import IGNORE_INDEX, CausalLM, Objective, count_tokens

__all__ = ["IGNORE_INDEX", "CausalLM", "Objective", "count_tokens"]
