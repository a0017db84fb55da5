"""Built-in chat tasks from the synthetic generator: copy and sort, as SFT and preference data.

A synthetic ``"copy: a b c -> a b c"`` line becomes a user turn (``"copy: a b c"``) and the
assistant's answer (``"a b c"``). A rejected answer for DPO is the correct one with one
item changed, so the pair differs only where the task is done wrong. Examples are indexed;
``split`` "train" and "eval" use disjoint index ranges, so evaluation is held out.
"""

from __future__ import annotations

import random
from typing import Literal

from temper.data.prompts import PromptRecord
from temper.data.sources import ListSource
from temper.data.synthetic import _copy, _sort

Split = Literal["train", "eval"]
_EVAL_OFFSET = 10_000_000


def task_example(seed: int, index: int) -> tuple[str, str]:
    """(question, answer) number ``index`` of the stream for ``seed``."""
    rng = random.Random(f"temper.tasks:{seed}:{index}")
    question, answer = rng.choice((_copy, _sort))(rng).split(" -> ")
    return question, answer


def _index(split: Split, i: int) -> int:
    return i + (_EVAL_OFFSET if split == "eval" else 0)


def sft_conversations(seed: int, split: Split, count: int) -> list[list[dict[str, str]]]:
    """``count`` one-turn conversations of ``split``."""
    conversations = []
    for i in range(count):
        question, answer = task_example(seed, _index(split, i))
        conversations.append(
            [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        )
    return conversations


def wrong_answer(answer: str, rng: random.Random) -> str:
    """``answer`` with one of its items replaced by a different one of the same kind."""
    items = answer.split(" ")
    k = rng.randrange(len(items))
    pool = "0123456789" if items[k].isdigit() else "abcdefghijklmnopqrstuvwxyz"
    items[k] = rng.choice([c for c in pool if c != items[k]])
    return " ".join(items)


def preference_pairs(
    seed: int, split: Split, count: int
) -> list[tuple[list[dict[str, str]], list[dict[str, str]], list[dict[str, str]]]]:
    """``count`` (prompt, chosen, rejected) message triples of ``split``."""
    pairs = []
    for i in range(count):
        question, answer = task_example(seed, _index(split, i))
        rng = random.Random(f"temper.tasks.rejected:{seed}:{_index(split, i)}")
        pairs.append(
            (
                [{"role": "user", "content": question}],
                [{"role": "assistant", "content": answer}],
                [{"role": "assistant", "content": wrong_answer(answer, rng)}],
            )
        )
    return pairs


def task_prompts(seed: int, split: Split, count: int) -> list[PromptRecord]:
    """``count`` (user message, record with the reference answer) prompts of ``split``, for
    RL."""
    prompts = []
    for i in range(count):
        question, answer = task_example(seed, _index(split, i))
        record = {"prompt": question, "answer": answer}
        prompts.append(([{"role": "user", "content": question}], record))
    return prompts


def task_source(format: str, seed: int, split: Split, count: int) -> ListSource:
    """The built-in tasks of a chat ``format`` (sft, preference, prompt) as records."""
    if format == "sft":
        records = [{"messages": c} for c in sft_conversations(seed, split, count)]
    elif format == "preference":
        records = [
            {"prompt": p, "chosen": c, "rejected": r}
            for p, c, r in preference_pairs(seed, split, count)
        ]
    else:
        records = [record for _, record in task_prompts(seed, split, count)]
    return ListSource(records, f"builtin {format} {split}")
