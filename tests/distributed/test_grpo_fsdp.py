"""GRPO under FSDP2 trains what one process trains.

Two data-parallel ranks, each rolling out its own prompt, against one process accumulating
both prompts as micro-batches. Samplers are seeded by (seed, step, data rank x micro-batch),
so both layouts draw the same completions; then the losses, gradient norms and rollout
metrics (averaged over ranks) must agree. The FSDP run also offloads the optimizer around
every rollout (its DTensor state goes to CPU and back) and has a KL term: to a frozen
reference sharded like the policy, or, with the recipe's LoRA, to the base with the
adapters off.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import run_on_ranks
from training import assert_same_metrics

from temper.config import Config
from temper.objectives import register_reward
from temper.recipes.posttrain import grpo_debug

pytestmark = pytest.mark.slow

STEPS = 3


@register_reward("test_digit_share")
def digit_share(prompt: str, completion: str, answer: str) -> float:
    """A reward that a random model already earns unevenly: the share of digit characters."""
    chars = completion.replace(" ", "")
    return sum(c.isdigit() for c in chars) / max(len(chars), 1)


def _config(folder: Path, local_batch: int, offload: bool, lora: bool) -> Config:
    config = grpo_debug()
    config.job.dump_folder = str(folder)
    config.checkpoint.initial_recipe = None  # a random policy: no SFT first
    config.lora.enable = lora  # off: the KL reference is a frozen copy, sharded like the policy
    config.metrics.tensorboard = False
    config.training.steps = STEPS
    config.training.seq_len = 40
    config.training.local_batch_size = local_batch
    config.training.global_batch_size = 2
    config.optimizer.lr = 1e-3
    config.optimizer.offload_during_rollout = offload
    objective = config.objective
    objective.group_size, objective.max_new_tokens = 4, 8
    objective.rewards, objective.kl_coef, objective.updates_per_rollout = (
        ["test_digit_share"],
        0.1,
        2,
    )
    return config


def _train(config: Config) -> list[dict[str, float]] | None:
    import json

    from temper.trainer import Trainer

    trainer = Trainer(config)
    trainer.train()
    if not trainer.engine.runtime.is_main:
        return None
    path = Path(config.job.dump_folder) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("lora", [False, True], ids=["frozen_reference", "lora"])
def test_grpo_with_fsdp2_and_offload_trains_like_one_process(tmp_path: Path, lora: bool) -> None:
    single = run_on_ranks(_train, 1, _config(tmp_path / "single", 1, offload=False, lora=lora))[0]
    fsdp = run_on_ranks(_train, 2, _config(tmp_path / "fsdp", 1, offload=True, lora=lora))[0]
    assert_same_metrics(fsdp, single)
    assert any(row["grad_norm"] > 0 for row in single)  # rewards differed within groups
    for row, ref in zip(fsdp, single, strict=True):
        for name in ("reward_mean", "reward_std", "response_length", "clip_fraction", "kl"):
            assert row[name] == pytest.approx(ref[name], rel=1e-5, abs=1e-7), name
