"""The policy-loss variants against sums worked out by hand: asymmetric clipping, each
normalizer (grpo, dapo, bnpo, dr_grpo, gspo: value and gradient, and over a step of two
micro-batches as TRL divides them), GSPO's sequence ratio, the advantage scalings,
truncated importance sampling, DAPO's overlong punishment, and their config fields."""

from __future__ import annotations

import math

import pytest
import torch

from temper.config import Config, ConfigError, Data, Training
from temper.objectives.grpo import GRPOConfig
from temper.objectives.policy_loss import (
    ADVANTAGE_EPS,
    LossName,
    PolicyLoss,
    batch_std,
    group_advantages,
    overlong_penalty,
)


def _log(values: list[list[float]]) -> torch.Tensor:
    return torch.log(torch.tensor(values))


def test_token_loss_with_clip_higher_by_hand() -> None:
    new = _log([[1.0, 1.5, 0.5], [1.0, 1.5, 0.5]])  # ratios against old = 0
    old = torch.zeros(2, 3)
    completion = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([2.0, -1.0])
    policy = PolicyLoss("dapo", clip_low=0.2, clip_high=0.28)
    per_token, ratio, metrics = policy(new, old, adv, completion)
    # A = 2: -min(2r, 2 clip(r)) with r capped at 1.28: -2, -2.56, -1 (0.5 is not floored:
    # min picks 2 * 0.5). A = -1: -min(-r, -clip(r)): 1, 1.5 (the last token is masked).
    want = torch.tensor([[-2.0, -2.56, -1.0], [1.0, 1.5, 0.0]])
    torch.testing.assert_close(per_token, want)
    torch.testing.assert_close(ratio[completion], torch.exp(new)[completion])
    assert metrics["clip_fraction"].item() == pytest.approx(1 / 5)  # only 1.5 at A = 2
    assert policy.count(completion).item() == 5


# Two rows of 3 and 1 completion tokens, advantages 1 and -2, token ratios 1.1, 0.95, 1 and
# 1.05 (inside the 0.2 clip): each token's loss is -A r, its gradient d/dlogp = -A r.
NEW = [[1.1, 0.95, 1.0], [1.05, 1.0, 1.0]]
COMPLETION = [[True, True, True], [True, False, False]]
ADVANTAGES = [1.0, -2.0]
ROW0, ROW1 = -(1.1 + 0.95 + 1.0), 2 * 1.05  # each row's token sum of -A r


@pytest.mark.parametrize(
    ("name", "value", "count", "row_divisors"),
    [
        ("grpo", ROW0 / 3 + ROW1 / 1, 2, (3, 1)),  # each completion's mean, then over rows
        ("dapo", ROW0 + ROW1, 4, (1, 1)),  # every token of the step
        ("bnpo", (ROW0 + ROW1) / 4, 1, (4, 4)),  # the micro-batch's tokens, once per batch
        ("dr_grpo", ROW0 + ROW1, 2 * 5, (1, 1)),  # rows x max_new_tokens
    ],
)
def test_each_normalizer_by_hand_value_and_gradient(
    name: LossName, value: float, count: int, row_divisors: tuple[int, int]
) -> None:
    new = _log(NEW).requires_grad_()
    completion = torch.tensor(COMPLETION)
    policy = PolicyLoss(name, max_new_tokens=5)
    per_token, _, _ = policy(new, torch.zeros(2, 3), torch.tensor(ADVANTAGES), completion)
    loss = policy.reduce(per_token, completion, completion.sum(dim=1))
    assert loss.item() == pytest.approx(value, rel=1e-6)
    assert policy.count(completion).item() == count
    loss.backward()
    r = torch.tensor(NEW)
    want = torch.stack([-1.0 * r[0] / row_divisors[0], 2.0 * r[1] / row_divisors[1]])
    torch.testing.assert_close(new.grad, want * completion)


def test_a_step_of_two_micro_batches_is_divided_as_trl_divides_it() -> None:
    """The trainer divides the summed losses by the summed counts; TRL averages grpo and
    dr_grpo per micro-batch, then over accumulation steps, bnpo per micro-batch by its own
    tokens, dapo by the step's tokens. Per-token losses of two micro-batches of two rows:"""
    first = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    second = torch.tensor([[4.0, 5.0, 6.0], [7.0, 8.0, 0.0]])
    masks = [first != 0, second != 0]  # 3 and 5 completion tokens
    trl = {
        "grpo": ((1.5 + 3.0) / 2 + (5.0 + 7.5) / 2) / 2,
        "dapo": 36.0 / 8,
        "bnpo": (6.0 / 3 + 30.0 / 5) / 2,
        "dr_grpo": (6.0 / (2 * 4) + 30.0 / (2 * 4)) / 2,
    }
    for name, want in trl.items():
        policy = PolicyLoss(name, max_new_tokens=4)
        total = sum(
            policy.reduce(x, m, m.sum(dim=1)) for x, m in zip([first, second], masks, strict=True)
        )
        count = sum(policy.count(m) for m in masks)
        assert (total / count).item() == pytest.approx(want), name


def test_sequence_parallel_slices_add_up_to_the_whole_rows() -> None:
    """Under SP each rank holds a slice of every row: the per-completion and per-batch sums
    divide by the whole rows' lengths, and only the first slice counts rows, so the slices'
    sums and counts add up to the unsliced step's."""
    per_token = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0]])
    mask = per_token != 0
    lengths = mask.sum(dim=1)
    for name in ("grpo", "dapo", "bnpo", "dr_grpo"):
        policy = PolicyLoss(name, max_new_tokens=4)
        whole = policy.reduce(per_token, mask, lengths) / policy.count(mask)
        slices = [(slice(0, 2), True), (slice(2, 4), False)]
        total = sum(policy.reduce(per_token[:, s], mask[:, s], lengths) for s, _ in slices)
        count = sum(policy.count(mask[:, s], first) for s, first in slices)
        assert (total / count).item() == pytest.approx(whole.item()), name


def test_advantage_scalings_by_hand() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 1.0, 1.0, 3.0])
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25, 1.0, -1.0, -1.0, 1.0])
    group_std = torch.tensor([0.5] * 4 + [2 / math.sqrt(3)] * 4)  # unbiased, per group
    batch_std_by_hand = math.sqrt(((rewards - 1.125) ** 2).sum().item() / 7)  # unbiased
    torch.testing.assert_close(group_advantages(rewards, 4, scale=False), centred)
    torch.testing.assert_close(group_advantages(rewards, 4), centred / (group_std + ADVANTAGE_EPS))
    for scale in ("none", "batch"):  # batch: divided once the whole step is drawn
        got = PolicyLoss("dr_grpo", scale=scale).advantages(rewards, 4)
        assert got.tolist() == centred.tolist()
    sums = torch.tensor([8.0, rewards.sum().item(), (rewards**2).sum().item()])
    assert batch_std(sums).item() == pytest.approx(batch_std_by_hand)
    assert batch_std(torch.tensor([1.0, 3.0, 9.0])).item() == 0.0  # one reward: no spread


def test_gspo_ratio_is_per_completion_by_hand() -> None:
    new = _log([[1.5, 0.5], [2.0, 2.0], [2.0, 2.0]]).requires_grad_()
    old = torch.zeros(3, 2)
    completion = torch.ones(3, 2, dtype=torch.bool)
    adv = torch.tensor([2.0, -1.0, 1.0])
    policy = PolicyLoss("gspo", clip_low=0.2, clip_high=0.2)
    per_token, ratio, metrics = policy(new, old, adv, completion)
    assert ratio.shape == (3, 1)
    loss = policy.reduce(per_token, completion, completion.sum(dim=1))
    s0 = math.sqrt(1.5 * 0.5)  # geometric mean of the token ratios: 0.866, inside the clip
    # Row 1: s = 2, A < 0: -min(-2, -1.2) = 2 (unclipped); row 2: s = 2, A > 0: capped, -1.2.
    assert loss.item() == pytest.approx(-2 * s0 + 2 - 1.2)
    assert metrics["clip_fraction"].item() == pytest.approx(1 / 3)
    assert policy.count(completion).item() == 3  # completions, not tokens
    loss.backward()
    # d(-A s)/d logp_t = -A s / n for an unclipped row; a clipped row has no gradient.
    want = torch.tensor([[-s0, -s0], [1.0, 1.0], [0.0, 0.0]])
    torch.testing.assert_close(new.grad, want)
    # A per-token term (the KL) is averaged per completion, then summed.
    kl = torch.tensor([[1.0, 3.0], [2.0, 0.0], [5.0, 5.0]])
    half = torch.tensor([[True, True], [True, False], [True, True]])
    assert policy.reduce(kl, half, half.sum(dim=1)).item() == pytest.approx(2 + 2 + 5)


def test_truncated_importance_sampling_weighs_by_the_capped_sampler_ratio() -> None:
    old = _log([[0.2, 0.1, 0.3]])
    sampler = _log([[0.1, 0.2, 0.3]])  # old / sampler: 2 (capped to 1.5), 0.5, 1
    completion = torch.ones(1, 3, dtype=torch.bool)
    adv = torch.tensor([1.0])
    token = PolicyLoss("dapo", tis_cap=1.5)
    loss, _, _ = token(old, old, adv, completion, sampler)  # on-policy: each token's loss is -1
    torch.testing.assert_close(loss, torch.tensor([[-1.5, -0.5, -1.0]]))
    sequence = PolicyLoss("gspo", tis_cap=1.5)
    loss, _, _ = sequence(old, old, adv, completion, sampler)  # exp(mean log gap) = 1
    torch.testing.assert_close(loss, -torch.ones(1, 3))
    with pytest.raises(ValueError, match="tis_cap needs the sampler's log-probs"):
        token(old, old, adv, completion)


def test_overlong_penalty_by_hand() -> None:
    got = overlong_penalty(torch.tensor([5, 6, 8, 10]), max_new_tokens=10, buffer=4, penalty=0.5)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5]))


def test_loss_fields_build_the_variant_and_bad_ones_fail_by_name() -> None:
    section = GRPOConfig(
        loss="gspo", clip_eps=3e-4, clip_high=4e-4, tis_cap=2.0, advantage_scale="batch"
    )
    want = PolicyLoss("gspo", 3e-4, 4e-4, 2.0, section.max_new_tokens, scale="batch")
    assert section.policy_loss() == want
    assert GRPOConfig().policy_loss().name == "dapo"  # TRL's default, and the old 'grpo'

    assert GRPOConfig().policy_loss().clip_high == 0.2  # None: symmetric
    for change, message in [
        ({"tis_cap": 0.0}, "objective.tis_cap must be > 0"),
        ({"clip_high": -0.1}, "objective.clip_high must be >= 0"),
        ({"overlong_buffer": 17}, r"objective.overlong_buffer must be in \[0, "),
        ({"accuracy_reward": "nope"}, "objective.accuracy_reward: 'nope' not registered"),
    ]:
        config = Config(
            training=Training(seq_len=48),
            data=Data(format="prompt"),
            objective=GRPOConfig(max_new_tokens=16, **change),
        )
        with pytest.raises(ConfigError, match=message):
            config.validate(1)
