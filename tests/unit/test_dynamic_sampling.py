"""DAPO's dynamic sampling on scripted rollouts: groups whose advantages are all 0 are
dropped, further prompt micro-batches refill the batch in their order, and rows of different
widths are joined without training on the padding."""

from __future__ import annotations

import torch

from temper.data.batch import IGNORE_INDEX, Batch
from temper.objectives.dynamic_sampling import fill_rollout

# Per draw: the rollout's width and each row's advantage (groups of 2 rows).
SCRIPT = [(3, [0.0, 0.0, 1.0, -1.0]), (5, [0.0, 0.0, 0.0, 0.0]), (4, [0.5, -0.5, 2.0, -2.0])]


def _scripted_sample(calls: list[int]):
    def sample(prompts: Batch, generator: torch.Generator) -> tuple[Batch, dict[str, float]]:
        draw = len(calls)
        calls.append(int(prompts["prompt_ids"][0, 0]))
        width, advantages = SCRIPT[draw]
        ids = torch.arange(4 * width).view(4, width) + 100 * draw
        batch = {
            "input_ids": ids,
            "labels": ids.clone(),
            "advantages": torch.tensor(advantages),
        }
        return batch, {"reward_mean": float(draw), "logprob_diff_max": float(draw) / 10}

    return sample


def test_uninformative_groups_are_replaced_from_further_prompts_in_order() -> None:
    calls: list[int] = []
    drawn = iter([{"prompt_ids": torch.full((2, 3), k)} for k in (1, 2, 3)])
    seeds: list[int] = []

    def sampler(draw: int) -> torch.Generator:
        seeds.append(draw)
        return torch.Generator().manual_seed(draw)

    batch, metrics = fill_rollout(
        _scripted_sample(calls),
        {"prompt_ids": torch.zeros(2, 3, dtype=torch.long)},
        lambda: next(drawn),
        sampler,
        group_size=2,
        draws=4,
    )
    assert calls == [0, 1, 2] and seeds == [0, 1, 2]  # stopped once two groups had signal
    # Kept: draw 0's second group (width 3) and draw 2's first group (width 4).
    assert batch["advantages"].tolist() == [1.0, -1.0, 0.5, -0.5]
    assert batch["input_ids"].shape == (4, 4)
    assert batch["input_ids"][:2, :3].tolist() == [[6, 7, 8], [9, 10, 11]]
    assert batch["input_ids"][:2, 3].tolist() == [0, 0]
    assert batch["labels"][:2, 3].tolist() == [IGNORE_INDEX, IGNORE_INDEX]
    assert batch["input_ids"][2:].tolist() == [[200, 201, 202, 203], [204, 205, 206, 207]]
    assert metrics == {"reward_mean": 1.0, "logprob_diff_max": 0.2, "sampling_draws": 3.0}


def test_a_batch_still_short_is_topped_up_with_dropped_groups() -> None:
    calls: list[int] = []
    drawn = iter([{"prompt_ids": torch.full((2, 3), 1)}])
    batch, metrics = fill_rollout(
        _scripted_sample(calls),
        {"prompt_ids": torch.zeros(2, 3, dtype=torch.long)},
        lambda: next(drawn),
        lambda draw: torch.Generator(),
        group_size=2,
        draws=2,
    )
    assert calls == [0, 1]
    # One informative group found; the first dropped one (draw 0's) fills the batch.
    assert batch["advantages"].tolist() == [1.0, -1.0, 0.0, 0.0]
    assert batch["input_ids"][2:, :3].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert metrics["sampling_draws"] == 2.0
