"""Rewards by name: ``objective.rewards`` picks functions registered here, and sums them.

A reward scores one completion: ``reward(prompt, completion, record) -> float``, with the
rendered prompt text, the completion's text (without its stop token) and the prompt's whole
JSONL record (every field; the built-in rewards read ``record["answer"]``, the reference
answer). A user module (the recipe's MODULE) adds its own with ``@register_reward("name")``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

from temper.utils.registry import Registry

Record = Mapping[str, Any]
"""A prompt's JSONL record, every field as read."""

Reward = Callable[[str, str, Record], float]

_REWARDS: Registry[Reward] = Registry("reward")
register_reward = _REWARDS.decorator
"""``@register_reward("name")`` makes a reward function a choice of ``objective.rewards``."""
reward_names = _REWARDS.names
get_reward = _REWARDS.get


def _answer(record: Record) -> str:
    return record.get("answer", "")


@register_reward("exact_match")
def exact_match(prompt: str, completion: str, record: Record) -> float:
    """1 when the completion is the answer (outer whitespace aside), else 0."""
    return float(completion.strip() == _answer(record).strip())


_ITEM_LIST = re.compile(r"[a-z0-9]( [a-z0-9])*")


@register_reward("format")
def list_format(prompt: str, completion: str, record: Record) -> float:
    """1 when the completion has the built-in tasks' answer form, single letters or digits
    separated by single spaces, with as many items as the answer; else 0."""
    text = completion.strip()
    return float(bool(_ITEM_LIST.fullmatch(text)) and len(text) == len(_answer(record).strip()))


@register_reward("item_match")
def item_match(prompt: str, completion: str, record: Record) -> float:
    """Partial credit for list answers: the fraction of positions whose item is right, over
    the longer of the two lists (so extra or missing items cost too)."""
    got, want = completion.split(), _answer(record).split()
    if not want:
        return float(not got)
    return sum(g == w for g, w in zip(got, want, strict=False)) / max(len(got), len(want))


_BOXED = "\\boxed{"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def boxed_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` (nested braces balanced), or None
    when there is none or it never closes."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, begin = 1, start + len(_BOXED)
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
    return None


def final_number(text: str) -> Fraction | None:
    """The last number in ``text`` (``-1,234.5``, ``3/4``; thousands commas dropped) as an
    exact fraction, or None."""
    found = _NUMBER.findall(text)
    return Fraction(found[-1].replace(",", "")) if found else None


def same_math_answer(got: str, want: str) -> bool:
    """Equal as numbers when both are one number (``0.50`` is ``1/2``), else as text without
    spaces and ``$`` signs."""
    got, want = (re.sub(r"[\s$]", "", s) for s in (got, want))
    if _NUMBER.fullmatch(got) and _NUMBER.fullmatch(want):
        return final_number(got) == final_number(want)
    return got == want


@register_reward("boxed_match")
def boxed_match(prompt: str, completion: str, record: Record) -> float:
    """1 when the completion's last ``\\boxed{...}`` holds the answer (as a number or as
    text, see ``same_math_answer``), else 0."""
    boxed = boxed_answer(completion)
    return float(boxed is not None and same_math_answer(boxed, _answer(record)))


@register_reward("final_number")
def final_number_match(prompt: str, completion: str, record: Record) -> float:
    """1 when the last number in the completion equals the answer's number (GSM8K-style
    ``#### 42`` or a closing sentence alike), else 0."""
    got, want = final_number(completion), final_number(_answer(record))
    return float(got is not None and got == want)


@register_reward("boxed_format")
def boxed_format(prompt: str, completion: str, record: Record) -> float:
    """1 when the completion states exactly one ``\\boxed{...}`` answer, closed, else 0: a
    format reward that does not look at the answer."""
    return float(completion.count(_BOXED) == 1 and boxed_answer(completion) is not None)
