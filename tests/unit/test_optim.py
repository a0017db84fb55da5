"""LR schedule values computed by hand, and the weight-decay split."""

from __future__ import annotations

import math

import pytest
import torch

from temper.config import LRScheduler, Optimizer
from temper.optim import build_lr_scheduler, build_optimizer, lr_factor


def test_warmup_then_cosine_by_hand() -> None:
    config = LRScheduler(warmup_steps=4, decay="cosine", min_lr_ratio=0.1)
    factors = [lr_factor(step, 10, config) for step in range(10)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    # 6 decay steps; step 4 is 1/6 of the way, the last step ends at the floor.
    assert factors[4] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 6)))
    assert factors[9] == pytest.approx(0.1)


def test_linear_decay_by_hand() -> None:
    config = LRScheduler(warmup_steps=0, decay="linear", min_lr_ratio=0.0)
    assert [lr_factor(s, 4, config) for s in range(4)] == [0.75, 0.5, 0.25, 0.0]


def test_wsd_holds_then_decays() -> None:
    config = LRScheduler(warmup_steps=2, decay="wsd", decay_ratio=0.3, min_lr_ratio=0.0)
    factors = [lr_factor(s, 10, config) for s in range(10)]
    # 3 decay steps at the end; steps 2..6 stay at the peak.
    assert factors == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2 / 3, 1 / 3, 0.0])


def test_scheduler_drives_the_optimizer() -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(model, Optimizer(lr=1.0))
    scheduler = build_lr_scheduler(optimizer, LRScheduler(warmup_steps=2, decay="linear"), 4)
    seen = []
    for _ in range(4):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.5, 1.0, 0.5, 0.0])


def test_weight_decay_only_on_matrices() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    optimizer = build_optimizer(model, Optimizer(weight_decay=0.1))
    by_decay = {g["weight_decay"]: {id(p) for p in g["params"]} for g in optimizer.param_groups}
    assert by_decay[0.1] == {id(model[0].weight)}
    assert by_decay[0.0] == {id(model[0].bias), id(model[1].weight), id(model[1].bias)}
