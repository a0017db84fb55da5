"""The policy-loss variants against sums worked out by hand: asymmetric clipping, GSPO's
sequence ratio (value and gradient), Dr. GRPO's advantages and constant normalizer,
truncated importance sampling, DAPO's overlong punishment, and their config fields."""

from __future__ import annotations

import math

import pytest
import torch

from temper.config import Config, ConfigError, Data, Training
from temper.objectives.grpo import GRPOConfig
from temper.objectives.policy_loss import PolicyLoss, overlong_penalty


def _log(values: list[list[float]]) -> torch.Tensor:
    return torch.log(torch.tensor(values))


def test_grpo_token_loss_with_clip_higher_by_hand() -> None:
    new = _log([[1.0, 1.5, 0.5], [1.0, 1.5, 0.5]])  # ratios against old = 0
    old = torch.zeros(2, 3)
    completion = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([2.0, -1.0])
    loss, metrics = PolicyLoss("grpo", clip_low=0.2, clip_high=0.28)(new, old, adv, completion)
    # A = 2: -min(2r, 2 clip(r)) with r capped at 1.28: -2, -2.56, -1 (0.5 is not floored:
    # min picks 2 * 0.5). A = -1: -min(-r, -clip(r)): 1, 1.5 (the last token is masked).
    assert loss.item() == pytest.approx(-2 - 2.56 - 1 + 1 + 1.5)
    assert metrics["clip_fraction"].item() == pytest.approx(1 / 5)  # only 1.5 at A = 2
    assert PolicyLoss("grpo").count(completion).item() == 5


def test_gspo_ratio_is_per_completion_by_hand() -> None:
    new = _log([[1.5, 0.5], [2.0, 2.0], [2.0, 2.0]]).requires_grad_()
    old = torch.zeros(3, 2)
    completion = torch.ones(3, 2, dtype=torch.bool)
    adv = torch.tensor([2.0, -1.0, 1.0])
    policy = PolicyLoss("gspo", clip_low=0.2, clip_high=0.2)
    loss, metrics = policy(new, old, adv, completion)
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
    assert policy.reduce(kl, half).item() == pytest.approx(2 + 2 + 5)


def test_dr_grpo_centres_without_std_and_divides_by_a_constant() -> None:
    policy = PolicyLoss("dr_grpo", max_new_tokens=8)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 1.0, 1.0, 3.0])
    torch.testing.assert_close(
        policy.advantages(rewards, 4),
        torch.tensor([0.75, -0.25, -0.25, -0.25, 1.0, -1.0, -1.0, 1.0]),
    )
    completion = torch.tensor([[True, True, False], [True, False, False]])
    assert policy.count(completion).item() == 2 * 8  # rows x max_new_tokens, whatever the rows
    loss, _ = policy(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([1.0, -2.0]), completion)
    assert loss.item() == pytest.approx(-1 - 1 + 2)  # on-policy: the token sum of -A


def test_truncated_importance_sampling_weighs_by_the_capped_sampler_ratio() -> None:
    old = _log([[0.2, 0.1, 0.3]])
    sampler = _log([[0.1, 0.2, 0.3]])  # old / sampler: 2 (capped to 1.5), 0.5, 1
    completion = torch.ones(1, 3, dtype=torch.bool)
    adv = torch.tensor([1.0])
    token = PolicyLoss("grpo", tis_cap=1.5)
    loss, _ = token(old, old, adv, completion, sampler)  # on-policy: each token's loss is -1
    assert loss.item() == pytest.approx(-(1.5 + 0.5 + 1.0))
    sequence = PolicyLoss("gspo", tis_cap=1.5)
    loss, _ = sequence(old, old, adv, completion, sampler)  # exp(mean log gap) = 1
    assert loss.item() == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="tis_cap needs the sampler's log-probs"):
        token(old, old, adv, completion)


def test_overlong_penalty_by_hand() -> None:
    got = overlong_penalty(torch.tensor([5, 6, 8, 10]), max_new_tokens=10, buffer=4, penalty=0.5)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5]))


def test_loss_fields_build_the_variant_and_bad_ones_fail_by_name() -> None:
    section = GRPOConfig(loss="gspo", clip_eps=3e-4, clip_high=4e-4, tis_cap=2.0)
    assert section.policy_loss() == PolicyLoss("gspo", 3e-4, 4e-4, 2.0, section.max_new_tokens)
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
