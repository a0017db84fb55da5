"""GRPO on your own prompts with your own reward: a JSONL file of questions whose records
carry extra fields, and a reward in this module that reads them.

    MODULE=examples.grpo_arithmetic CONFIG=arithmetic ./run_train.sh --training.steps 20

Each record of ``arithmetic_prompts.jsonl`` holds ``prompt``, ``answer`` and ``tolerance``,
a field of this task's own: the distance from the answer at which the reward halves. The
reward below gets the whole record (``reward(prompt, completion, record)``) and is a choice
of ``--objective.rewards`` once this module is imported (run_train.sh imports MODULE). Any
``--section.field`` applies, e.g. ``--objective.loss dr_grpo`` or ``--data.path mine.jsonl``.
"""

from __future__ import annotations

from pathlib import Path

from temper.config import Config
from temper.objectives import register_reward
from temper.objectives.rewards import Record, final_number
from temper.recipes.posttrain import grpo_debug

PROMPTS = Path(__file__).with_name("arithmetic_prompts.jsonl")


@register_reward("arithmetic_closeness")
def arithmetic_closeness(prompt: str, completion: str, record: Record) -> float:
    """1 for the right sum; less the further the completion's last number is from it, on
    the record's own ``tolerance`` scale (half credit at that distance); 0 without a number."""
    got = final_number(completion)
    if got is None:
        return 0.0
    return 1.0 / (1.0 + abs(float(got) - float(record["answer"])) / record["tolerance"])


def arithmetic() -> Config:
    """grpo_debug's model and settings on this folder's prompts, from a random policy (no
    SFT start: the recipe shows the plumbing, not a good arithmetic model)."""
    config = grpo_debug()
    config.job.dump_folder = "./outputs/grpo_arithmetic"
    config.data.path = str(PROMPTS)
    config.checkpoint.initial_recipe = None
    config.training.steps = 20
    config.training.seq_len = 64
    config.objective.rewards = ["arithmetic_closeness"]
    config.objective.accuracy_reward = "final_number"
    return config
