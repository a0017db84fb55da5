"""Rewards by name: ``objective.rewards`` picks functions registered here, and sums them.

A reward scores one completion: ``reward(prompt, completion, answer) -> float``, with the
rendered prompt text, the completion's text (without its stop token) and the record's
reference answer. A user module (the recipe's MODULE) adds its own with
``@register_reward("name")``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from temper.utils.registry import Registry

Reward = Callable[[str, str, str], float]

_REWARDS: Registry[Reward] = Registry("reward")
register_reward = _REWARDS.decorator
"""``@register_reward("name")`` makes a reward function a choice of ``objective.rewards``."""
reward_names = _REWARDS.names
get_reward = _REWARDS.get


@register_reward("exact_match")
def exact_match(prompt: str, completion: str, answer: str) -> float:
    """1 when the completion is the answer (outer whitespace aside), else 0."""
    return float(completion.strip() == answer.strip())


_ITEM_LIST = re.compile(r"[a-z0-9]( [a-z0-9])*")


@register_reward("format")
def list_format(prompt: str, completion: str, answer: str) -> float:
    """1 when the completion has the built-in tasks' answer form, single letters or digits
    separated by single spaces, with as many items as the answer; else 0."""
    text = completion.strip()
    return float(bool(_ITEM_LIST.fullmatch(text)) and len(text) == len(answer.strip()))


@register_reward("item_match")
def item_match(prompt: str, completion: str, answer: str) -> float:
    """Partial credit for list answers: the fraction of positions whose item is right, over
    the longer of the two lists (so extra or missing items cost too)."""
    got, want = completion.split(), answer.split()
    if not want:
        return float(not got)
    return sum(g == w for g, w in zip(got, want, strict=False)) / max(len(got), len(want))
