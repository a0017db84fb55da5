"""DPO and IPO losses against hand computations on fixed log-probabilities."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from temper.objectives.dpo import DPO, preference_loss, sequence_log_probs

POLICY_C, POLICY_R = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -4.5])
REF_C, REF_R = torch.tensor([-3.5, -5.0]), torch.tensor([-3.5, -4.0])


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_sigmoid_loss_by_hand(smoothing: float) -> None:
    beta = 0.5
    # h = (pi_c - ref_c) - (pi_r - ref_r): pair 0: 0.5 - (-0.5) = 1.0; pair 1: 0 - (-0.5) = 0.5
    expected = [
        -(1 - smoothing) * _log_sigmoid(beta * h) - smoothing * _log_sigmoid(-beta * h)
        for h in (1.0, 0.5)
    ]
    losses = preference_loss(POLICY_C, POLICY_R, REF_C, REF_R, beta=beta, label_smoothing=smoothing)
    assert losses.tolist() == pytest.approx(expected, rel=1e-6)


def test_ipo_loss_by_hand() -> None:
    losses = preference_loss(POLICY_C, POLICY_R, REF_C, REF_R, beta=0.25, loss_type="ipo")
    assert losses.tolist() == pytest.approx([(1.0 - 2.0) ** 2, (0.5 - 2.0) ** 2])


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

    objective = DPO(beta=0.1, reference=reference)
    loss, count, metrics = objective.loss(policy, batch)
    h = (by_hand(policy, 0) - by_hand(reference, 0)) - (by_hand(policy, 1) - by_hand(reference, 1))
    assert count.item() == 1
    assert loss.item() == pytest.approx(-_log_sigmoid(0.1 * h), rel=1e-5)
    assert metrics["reward_margin"] == pytest.approx(0.1 * h, rel=1e-5)
    assert metrics["reward_accuracy"] == float(h > 0)
    assert sequence_log_probs(policy, ids, labels)[0].item() == pytest.approx(by_hand(policy, 0))
    loss.backward()
    assert policy.table.grad is not None and reference.table.grad is None
