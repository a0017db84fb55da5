"""Objectives by name: the config's ``objective.name`` picks a builder registered here.

A user module (the recipe's MODULE) can add its own with ``@register_objective("name")``.
A builder gets the run's Config and a function that builds a frozen reference model (a copy
of the policy, sharded like it); only objectives that need one call it.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from temper.config import Config
from temper.data.chat import load_chat_template, stop_token_ids
from temper.data.tokenizer import load_tokenizer
from temper.models.lora import adapters_disabled
from temper.objectives.causal_lm import CausalLM, Objective
from temper.objectives.dpo import DPO
from temper.objectives.grpo import GRPO
from temper.objectives.rewards import get_reward
from temper.utils.registry import Registry

Builder = Callable[[Config, Callable[[], nn.Module]], Objective]

_OBJECTIVES: Registry[Builder] = Registry("objective")
register_objective = _OBJECTIVES.decorator
"""``@register_objective("name")`` makes a builder a choice of ``objective.name``."""
objective_names = _OBJECTIVES.names


def build_objective(config: Config, build_reference: Callable[[], nn.Module]) -> Objective:
    """The objective ``objective.name`` names (``Config.validate`` has checked the name)."""
    return _OBJECTIVES.get(config.objective.name)(config, build_reference)


@register_objective("causal_lm")
def _causal_lm(config: Config, build_reference: Callable[[], nn.Module]) -> Objective:
    return CausalLM()


def _reference(
    config: Config, build_reference: Callable[[], nn.Module]
) -> dict[str, nn.Module | Callable | None]:
    """With LoRA the base weights never change: the policy with adapters off is the reference;
    otherwise a frozen copy."""
    lora = config.lora.enable
    return {
        "reference": None if lora else build_reference(),
        "reference_mode": adapters_disabled if lora else None,
    }


@register_objective("dpo")
def _dpo(config: Config, build_reference: Callable[[], nn.Module]) -> Objective:
    section = config.objective
    return DPO(
        beta=section.beta,
        label_smoothing=section.label_smoothing,
        loss_type=section.loss_type,
        **_reference(config, build_reference),
    )


@register_objective("grpo")
def _grpo(config: Config, build_reference: Callable[[], nn.Module]) -> Objective:
    section = config.objective
    folder = config.data.tokenizer_path or config.model.hf_path
    tokenizer = load_tokenizer(folder)
    template = load_chat_template(config.data.chat_template, folder)
    return GRPO(
        tokenizer=tokenizer,
        stop_tokens=stop_token_ids(tokenizer, template),
        rewards={name: get_reward(name) for name in section.rewards},
        reward_weights=section.reward_weights or [1.0] * len(section.rewards),
        group_size=section.group_size,
        max_new_tokens=section.max_new_tokens,
        temperature=section.temperature,
        top_k=section.top_k,
        top_p=section.top_p,
        clip_eps=section.clip_eps,
        kl_coef=section.kl_coef,
        updates_per_rollout=section.updates_per_rollout,
        **(_reference(config, build_reference) if section.kl_coef else {}),
    )
