"""A short GRPO run raises the reward it is trained on, measured on held-out prompts with the
same sampler seed before and after; and a run without initial_load trains its
initial_recipe first, once, and starts from that checkpoint's weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from temper.checkpoint.convert import load_checkpoint_model
from temper.config import Config, load_config
from temper.data.chat import BUILTIN_TEMPLATE
from temper.data.loader import BatchLoader
from temper.data.prompts import prompt_dataset
from temper.data.tasks import task_prompts
from temper.objectives import register_reward
from temper.recipes.posttrain import sft_debug
from temper.trainer.trainer import Trainer

pytestmark = pytest.mark.slow


@register_reward("test_digit_characters")
def digit_characters(prompt: str, completion: str, answer: str) -> float:
    """The share of the completion's characters that are digits: a goal that a random policy
    already meets now and then, so every group has something to compare."""
    chars = completion.replace(" ", "")
    return sum(c.isdigit() for c in chars) / max(len(chars), 1)


def _held_out_reward(trainer: Trainer) -> float:
    """Mean reward of 4 samples for each of 32 held-out prompts, with a fixed sampler seed."""
    config = trainer.config
    width = config.training.seq_len - config.objective.max_new_tokens
    records = task_prompts(config.training.seed, "eval", 32)
    dataset = prompt_dataset(records, trainer.engine.tokenizer, BUILTIN_TEMPLATE, width)
    prompts = next(iter(BatchLoader(dataset, 32)))
    _, metrics = trainer.objective.prepare(
        trainer.engine.model, prompts, torch.Generator().manual_seed(0)
    )
    return metrics["reward_mean"]


def test_a_short_grpo_run_raises_the_held_out_reward(tmp_path: Path) -> None:
    argv = [
        "--job.dump_folder", str(tmp_path), "--metrics.no_tensorboard",
        "--checkpoint.initial_recipe", "", "--lora.no_enable",
        "--training.steps", "8", "--training.seq_len", "40",
        "--training.local_batch_size", "4", "--optimizer.lr", "1e-2",
        "--objective.group_size", "4", "--objective.max_new_tokens", "8",
        "--objective.temperature", "1.0", "--objective.rewards", "test_digit_characters",
    ]  # fmt: skip
    trainer = Trainer(load_config("temper.recipes.posttrain", "grpo_debug", argv))
    before = _held_out_reward(trainer)
    trainer.train()
    after = _held_out_reward(trainer)
    assert after > before + 0.2, (before, after)  # measured: 0.45 -> 0.89
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(row["logprob_diff_max"] < 1e-4 for row in rows)


def tiny_sft() -> Config:
    """sft_debug cut to 2 steps: a starting recipe for the chain below."""
    config = sft_debug()
    config.training.steps, config.training.seq_len = 2, 32
    return config


def test_initial_recipe_trains_the_start_once_and_loads_it(tmp_path: Path) -> None:
    argv = [
        "--job.dump_folder", str(tmp_path), "--metrics.no_tensorboard",
        "--checkpoint.initial_recipe", f"{__name__}:tiny_sft --training.steps 3",
    ]  # fmt: skip
    trainer = Trainer(load_config("temper.recipes.posttrain", "grpo_debug", argv))
    start = tmp_path / "initial" / "checkpoints" / "step-3"  # the override applied
    assert trainer.config.checkpoint.initial_load == str(start)
    saved = load_checkpoint_model(start).state_dict()
    weights = trainer.engine.model.state_dict()  # the saved base weights, plus fresh LoRA adapters
    assert {name for name in weights if "lora_" not in name} == saved.keys()
    for name, value in saved.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0)
    stamp = (start / "temper.json").stat().st_mtime_ns
    again = Trainer(load_config("temper.recipes.posttrain", "grpo_debug", argv))
    assert again.config.checkpoint.initial_load == str(start)
    assert (start / "temper.json").stat().st_mtime_ns == stamp  # reused, not retrained
