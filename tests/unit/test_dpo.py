"""DPO and IPO losses against hand computations on fixed log-probabilities."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from temper.config import ConfigError, load_config
from temper.objectives.dpo import (
    DPO,
    DPOConfig,
    _log1mexp,
    preference_loss,
    sequence_log_probs,
)

POLICY_C, POLICY_R = [-3.0, -5.0], [-4.0, -4.5]
REF_C, REF_R = [-3.5, -5.0], [-3.5, -4.0]
TOKENS_C, TOKENS_R = [2.0, 4.0], [1.0, 3.0]
POLICY = torch.tensor(POLICY_C + POLICY_R)
REFERENCE = torch.tensor(REF_C + REF_R)
TOKENS = torch.tensor(TOKENS_C + TOKENS_R)


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def _losses(loss_type: str, **fields: float) -> list[float]:
    reference = None if loss_type in ("simpo", "orpo") else REFERENCE
    losses = preference_loss(POLICY, reference, TOKENS, loss_type=loss_type, **fields)
    return losses.tolist()


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cdpo_loss_by_hand(smoothing: float) -> None:
    beta = 0.5
    # h = (pi_c - ref_c) - (pi_r - ref_r): pair 0: 0.5 - (-0.5) = 1.0; pair 1: 0 - (-0.5) = 0.5
    expected = [
        -(1 - smoothing) * _log_sigmoid(beta * h) - smoothing * _log_sigmoid(-beta * h)
        for h in (1.0, 0.5)
    ]
    assert _losses("cdpo", beta=beta, label_smoothing=smoothing) == pytest.approx(expected)


def test_sigmoid_is_trls_and_refuses_label_smoothing() -> None:
    expected = [-_log_sigmoid(0.5 * h) for h in (1.0, 0.5)]
    assert _losses("sigmoid", beta=0.5) == pytest.approx(expected)
    with pytest.raises(ValueError, match="label_smoothing applies to loss_type 'cdpo'"):
        _losses("sigmoid", beta=0.5, label_smoothing=0.1)


def test_ipo_sums_and_ipo_norm_averages_the_log_ratios() -> None:
    """ipo is the paper's (summed log-ratios); ipo_norm divides each by its answer's tokens, as
    TRL's ipo does: pair 0: 0.5 / 2 - (-0.5) / 1 = 0.75; pair 1: 0 / 4 - (-0.5) / 3 = 1/6."""
    assert _losses("ipo", beta=0.25) == pytest.approx([(1.0 - 2.0) ** 2, (0.5 - 2.0) ** 2])
    expected = [(0.75 - 2.0) ** 2, (1 / 6 - 2.0) ** 2]
    assert _losses("ipo_norm", beta=0.25) == pytest.approx(expected)


def test_rpo_adds_the_chosen_nll_per_token() -> None:
    # The chosen answers' NLL per token: 3 / 2 and 5 / 4.
    expected = [-_log_sigmoid(0.5 * h) + 0.3 * nll for h, nll in ((1.0, 1.5), (0.5, 1.25))]
    assert _losses("rpo", beta=0.5, rpo_alpha=0.3) == pytest.approx(expected)


def test_simpo_compares_average_log_probs_with_a_margin() -> None:
    # Averages: chosen -1.5, -1.25; rejected -4, -1.5.
    expected = [-_log_sigmoid(2.0 * (c - r) - 0.4) for c, r in ((-1.5, -4.0), (-1.25, -1.5))]
    assert _losses("simpo", beta=2.0, simpo_gamma=0.4) == pytest.approx(expected)


def test_orpo_is_the_chosen_nll_plus_the_odds_ratio_term() -> None:
    def log_odds(p: float) -> float:  # log(p / (1 - p)) of the per-token probability
        return math.log(p / (1 - p))

    expected = []
    for c, r in ((-1.5, -4.0), (-1.25, -1.5)):
        ratio = log_odds(math.exp(c)) - log_odds(math.exp(r))
        expected.append(-c - 0.1 * _log_sigmoid(ratio))
    assert _losses("orpo", beta=0.1) == pytest.approx(expected, rel=1e-6)


class _FixedLogits(nn.Module):
    """A 'model' whose logits depend only on the input token: a learnable table."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.table = nn.Parameter(torch.randn(vocab, vocab, generator=generator))

    def forward(self, input_ids: torch.Tensor, *_: object, **__: object) -> torch.Tensor:
        """Positions, document masks and an SP shard, which a decoder takes, change nothing
        here."""
        return self.table[input_ids]


def test_dpo_objective_matches_hand_computation() -> None:
    policy, reference = _FixedLogits(7), _FixedLogits(7)
    with torch.no_grad():
        reference.table.mul_(0.5)
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 5, 6]])
    labels = torch.tensor([[-100, 3, 4, 0], [-100, 5, 6, 0]])
    batch = {
        "chosen_input_ids": ids[:1], "chosen_labels": labels[:1],
        "rejected_input_ids": ids[1:], "rejected_labels": labels[1:],
    }  # fmt: skip

    def by_hand(model: nn.Module, row: int) -> float:
        logp = model(ids[row]).log_softmax(-1)
        return sum(logp[t, labels[row, t]].item() for t in range(4) if labels[row, t] != -100)

    objective = DPO(DPOConfig(beta=0.1), reference=reference)
    loss, count, metrics = objective.loss(policy, batch)
    h = (by_hand(policy, 0) - by_hand(reference, 0)) - (by_hand(policy, 1) - by_hand(reference, 1))
    assert count.item() == 1
    assert loss.item() == pytest.approx(-_log_sigmoid(0.1 * h), rel=1e-5)
    assert metrics["reward_margin"] == pytest.approx(0.1 * h, rel=1e-5)
    assert metrics["reward_accuracy"] == float(h > 0)
    assert sequence_log_probs(policy, ids, labels)[0].item() == pytest.approx(by_hand(policy, 0))
    loss.backward()
    assert policy.table.grad is not None and reference.table.grad is None


class _Counted(_FixedLogits):
    """Counts its forwards, so a test sees whether a reference pass ran."""

    calls = 0

    def forward(self, input_ids: torch.Tensor, *_: object, **__: object) -> torch.Tensor:
        self.calls += 1
        return super().forward(input_ids)


@pytest.mark.parametrize("loss_type", ["simpo", "orpo"])
def test_reference_free_losses_build_and_run_no_reference(loss_type: str) -> None:
    """The section builds no reference (not even under LoRA), one forward runs, and the loss
    and rewards are the hand-computed ones from the answers' average log-probabilities."""

    def no_reference() -> nn.Module:
        raise AssertionError("a reference-free loss built a reference")

    config = load_config(
        "temper.recipes.posttrain", "dpo_debug", ["--objective.loss_type", loss_type]
    )
    config.kernels.fused_cross_entropy = False  # the stub policy gives logits, it has no head
    objective = config.objective.build(config, no_reference)
    assert objective.reference is None and objective.reference_mode is None
    policy = _Counted(7)
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 5, 6]])
    labels = torch.tensor([[-100, 3, 4, 0], [-100, -100, 6, 0]])  # 3 and 2 answer tokens
    batch = {
        "chosen_input_ids": ids[:1], "chosen_labels": labels[:1],
        "rejected_input_ids": ids[1:], "rejected_labels": labels[1:],
    }  # fmt: skip
    loss, count, metrics = objective.loss(policy, batch)
    assert policy.calls == 1 and count.item() == 1
    logp = [policy.table[ids[row]].log_softmax(-1) for row in (0, 1)]
    chosen = sum(logp[0][t, labels[0, t]].item() for t in (1, 2, 3)) / 3
    rejected = sum(logp[1][t, labels[1, t]].item() for t in (2, 3)) / 2
    beta = config.objective.beta
    if loss_type == "simpo":
        expected = -_log_sigmoid(beta * (chosen - rejected) - config.objective.simpo_gamma)
    else:
        odds = [a - math.log1p(-math.exp(a)) for a in (chosen, rejected)]
        expected = -chosen - beta * _log_sigmoid(odds[0] - odds[1])
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["reward_margin"].item() == pytest.approx(beta * (chosen - rejected), rel=1e-5)


def test_label_smoothing_is_refused_outside_cdpo() -> None:
    smoothing = ["--objective.label_smoothing", "0.1"]
    with pytest.raises(ConfigError, match="objective.label_smoothing applies to"):
        load_config("temper.recipes.posttrain", "dpo_debug", smoothing)
    cdpo = load_config(
        "temper.recipes.posttrain", "dpo_debug", [*smoothing, "--objective.loss_type", "cdpo"]
    )
    assert cdpo.objective.label_smoothing == 0.1


def test_log1mexp_is_accurate_on_both_sides_of_its_switch() -> None:
    """ORPO's log(1 - p) of a per-token probability p = e^x, against float64 math."""
    xs = [-1e-6, -0.3, -0.69, -0.7, -5.0]
    expected = [math.log(-math.expm1(x)) for x in xs]
    x = torch.tensor(xs, requires_grad=True)
    assert _log1mexp(x).tolist() == pytest.approx(expected, rel=1e-6)
    # d/dx log(1 - e^x) = -e^x / (1 - e^x) = 1 / (1 - e^-x), finite on both sides.
    _log1mexp(x).sum().backward()
    grads = [1 / -math.expm1(-v) for v in xs]
    assert x.grad.tolist() == pytest.approx(grads, rel=1e-4)
    tiny = torch.tensor([-1e-8], requires_grad=True)  # e^x rounds to 1 in fp32
    _log1mexp(tiny).sum().backward()
    assert torch.isfinite(tiny.grad).all()
