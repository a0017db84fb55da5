"""examples/grpo_arithmetic.py trains end to end: its reward, from the user's module, gets
each prompt's whole JSONL record (the task's own ``tolerance`` field too), and the first
step's logged loss and rollout metrics are what those rewards give by hand."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from temper.config import load_config
from temper.data.batch import IGNORE_INDEX
from temper.trainer.trainer import Trainer

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples"
GROUP = 4


def test_the_arithmetic_example_trains_on_its_records_and_reward(tmp_path: Path) -> None:
    argv = [
        "--job.dump_folder", str(tmp_path), "--metrics.no_tensorboard",
        "--training.steps", "2", "--training.local_batch_size", "2",
        "--objective.group_size", str(GROUP), "--objective.max_new_tokens", "6",
    ]  # fmt: skip
    trainer = Trainer(load_config("examples.grpo_arithmetic", "arithmetic", argv))
    objective = trainer.objective
    reward = objective.sampler.rewards["arithmetic_closeness"]
    calls: list[tuple[str, dict, float]] = []
    rollouts = []

    def spy(prompt: str, completion: str, record: dict) -> float:
        calls.append((completion, dict(record), reward(prompt, completion, record)))
        return calls[-1][2]

    def prepare(*args):
        rollouts.append(prepare_rollout(*args))
        return rollouts[-1]

    objective.sampler.rewards["arithmetic_closeness"] = spy
    prepare_rollout, objective.prepare = objective.prepare, prepare
    trainer.train()

    records = [json.loads(line) for line in (EXAMPLE / "arithmetic_prompts.jsonl").open()]
    assert len(calls) == 2 * 2 * GROUP  # 2 steps x 2 prompts x the group
    assert all(record in records and "tolerance" in record for _, record, _ in calls)
    # The reward by hand: closeness of the last number on the record's own scale.
    for completion, record, got in calls:
        numbers = re.findall(r"-?\d+(?:\.\d+)?", completion.replace(",", ""))
        far = abs(float(numbers[-1]) - int(record["answer"])) if numbers else None
        assert got == (0.0 if far is None else 1 / (1 + far / record["tolerance"]))
    rewards = torch.tensor([got for _, _, got in calls[: 2 * GROUP]]).view(2, GROUP)
    assert rewards.std(dim=1).max() > 0  # the random policy's numbers vary: a real signal

    # Step 1 is on-policy (ratio 1): loss = -sum_i A_i n_i / sum_i n_i.
    batch, metrics = rollouts[0]
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    torch.testing.assert_close(batch["advantages"], advantages.view(-1))
    tokens = (batch["labels"] != IGNORE_INDEX).sum(dim=1).float()
    want = -(advantages.view(-1) * tokens).sum() / tokens.sum()
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert abs(logged[0]["loss"] - want.item()) < 1e-5
    assert logged[0]["reward_mean"] == rewards.mean().item()
    # The per-rollout metrics: groups without signal by hand, the time split, the gap.
    agree = (rewards == rewards[:, :1]).all(dim=1).float().mean().item()
    assert logged[0]["no_signal_groups"] == agree
    assert 0 < logged[0]["rollout_time_share"] < 1
    assert logged[0]["rollout_seconds"] > 0 and logged[0]["train_seconds"] > 0
    assert 0 <= logged[0]["logprob_diff_mean"] <= logged[0]["logprob_diff_max"] < 1e-4


def test_dynamic_sampling_draws_more_prompts_until_groups_have_signal(tmp_path: Path) -> None:
    """The exact sum is rare for a random policy: most groups score 0 alike, so a rollout
    samples a second micro-batch of new prompts (in the loader's order) unless the first
    already had two informative groups; the logged draws follow that rule."""
    argv = [
        "--job.dump_folder", str(tmp_path), "--metrics.no_tensorboard",
        "--training.steps", "2", "--training.local_batch_size", "2",
        "--objective.group_size", "2", "--objective.max_new_tokens", "4",
        "--objective.rewards", "final_number", "--objective.dynamic_sampling",
        "--objective.dynamic_sampling_draws", "2",
    ]  # fmt: skip
    trainer = Trainer(load_config("examples.grpo_arithmetic", "arithmetic", argv))
    objective = trainer.objective
    prompts_seen, informative, sample = [], [], objective.prepare

    def prepare(model, prompts, generator, engine=None):
        prompts_seen.append(prompts["record_ids"])
        batch, metrics = sample(model, prompts, generator, engine)
        informative.append(int((batch["advantages"].view(-1, 2) != 0).any(dim=1).sum()))
        return batch, metrics

    objective.prepare = prepare
    trainer.train()
    want, call = [], 0
    for _ in range(2):
        draws = 1 if informative[call] == 2 else 2
        want.append(float(draws))
        call += draws
    assert call == len(prompts_seen)
    assert want[0] == 2.0  # the random start rarely states a sum: the refill ran
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [row["sampling_draws"] for row in logged] == want
    drawn = torch.cat(prompts_seen)
    assert len({tuple(row.tolist()) for row in drawn}) == len(drawn)  # no prompt twice
