"""The training step against a hand-written reference: accumulation, normalization, guards."""

from __future__ import annotations

import copy
import json
import math
import os
import re

import pytest
import torch
import torch.nn.functional as F

from temper.config import Config, Job, LRScheduler, Metrics, Model, Training
from temper.data.batch import IGNORE_INDEX
from temper.trainer import NonFiniteError, Trainer
from temper.utils.device import Runtime

CPU = Runtime(device=torch.device("cpu"), rank=0, local_rank=0, world_size=1)


def tiny_config(tmp_path, **training) -> Config:
    return Config(
        job=Job(dump_folder=str(tmp_path)),
        model=Model(name="llama3", flavor="debug"),
        training=Training(**{"steps": 3, "seq_len": 16, "local_batch_size": 2, **training}),
        lr_scheduler=LRScheduler(warmup_steps=1),
        metrics=Metrics(tensorboard=False),
    )


def batch(seed: int, n_ignored: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 600, (2, 17), generator=gen)
    labels = ids[:, 1:].clone()
    labels[0, :n_ignored] = IGNORE_INDEX
    return {"input_ids": ids[:, :-1], "labels": labels}


def test_step_loss_and_gradients_match_one_big_batch(tmp_path) -> None:
    trainer = Trainer(tiny_config(tmp_path, max_norm=0.0), runtime=CPU)
    reference = copy.deepcopy(trainer.engine.model)
    # Uneven masking: a mean of per-micro-batch means would differ from the token mean.
    micro = [batch(1, n_ignored=12), batch(2, n_ignored=0)]

    ids = torch.cat([mb["input_ids"] for mb in micro])
    labels = torch.cat([mb["labels"] for mb in micro])
    expected = F.cross_entropy(reference(ids).flatten(0, 1), labels.flatten(), ignore_index=-100)
    expected.backward()
    expected_norm = torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in reference.parameters()])
    )

    # The engine resolved its kernels for the model; its loss is the fused, chunked head.
    assert trainer.engine.model.kernels is trainer.engine.kernels
    assert trainer.objective.kernels.fused_cross_entropy
    metrics = trainer.train_step(micro)
    assert metrics["loss"] == pytest.approx(expected.item(), rel=1e-6)
    assert metrics["grad_norm"] == pytest.approx(expected_norm.item(), rel=1e-5)


def test_clipping_bounds_the_update(tmp_path) -> None:
    clipped = Trainer(tiny_config(tmp_path, max_norm=1e-3), runtime=CPU)
    before = [p.detach().clone() for p in clipped.engine.model.parameters()]
    clipped.engine.optimizer.param_groups[0]["weight_decay"] = 0.0
    metrics = clipped.train_step([batch(3, n_ignored=0)])
    assert metrics["grad_norm"] > 1e-3  # the reported norm is the one before clipping
    grads_seen = [
        state["exp_avg"] / (1 - clipped.config.optimizer.beta1)
        for p in clipped.engine.model.parameters()
        if (state := clipped.engine.optimizer.state[p])
    ]
    clipped_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads_seen]))
    assert clipped_norm.item() == pytest.approx(1e-3, rel=1e-4)
    assert any(
        not torch.equal(a, b)
        for a, b in zip(before, clipped.engine.model.parameters(), strict=True)
    )


def test_non_finite_loss_stops_without_an_update(tmp_path) -> None:
    trainer = Trainer(tiny_config(tmp_path), runtime=CPU)
    with torch.no_grad():
        trainer.engine.model.norm.weight[0] = float("nan")
    before = [p.detach().clone() for p in trainer.engine.model.parameters()]
    stopped = (
        "step 1: loss nan / grad norm nan is not finite; the update was not applied and "
        "training stopped; --training.skip_nonfinite N would skip up to N such steps"
    )
    with pytest.raises(NonFiniteError, match=re.escape(stopped)):
        trainer.train_step([batch(4, n_ignored=0)])
    after = list(trainer.engine.model.parameters())
    assert all(
        torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(before, after, strict=True)
    )
    assert not trainer.engine.optimizer.state  # AdamW never stepped


def poison_steps(trainer: Trainer, steps: set[int]) -> None:
    """Make the loss of each step in ``steps`` nan (its gradients then are nan too)."""
    loss = trainer.objective.loss

    def poisoned(model, batch):
        loss_sum, count, metrics = loss(model, batch)
        if trainer.state.step + 1 in steps:  # the step counter moves on after the forward
            loss_sum = loss_sum * float("nan")
        return loss_sum, count, metrics

    trainer.objective.loss = poisoned


def test_skip_nonfinite_drops_the_step_and_trains_on(tmp_path) -> None:
    """Step 3's loss is nan: the run equals, at every other step, a run that draws step 3's
    batch and throws it away with no update and no move of the learning-rate schedule."""
    skipping = Trainer(tiny_config(tmp_path / "skip", steps=5, skip_nonfinite=1), runtime=CPU)
    poison_steps(skipping, {3})
    skipping.train()
    rows = [json.loads(line) for line in (tmp_path / "skip" / "metrics.jsonl").open()]

    reference = Trainer(tiny_config(tmp_path / "ref", steps=5), runtime=CPU)
    batches, expected = iter(reference.loader), {}
    for step in range(1, 6):
        micro_batches = [next(batches) for _ in range(reference.grad_accum)]
        if step == 3:
            reference.state.step += 1
            continue
        metrics = reference.train_step(micro_batches)
        expected[step] = (metrics["loss"].item(), metrics["lr"].item())

    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    assert [row.get("skipped") for row in rows] == [None, None, 1.0, None, None]
    assert math.isnan(rows[2]["loss"]) and math.isnan(rows[2]["grad_norm"])
    assert {row["step"]: (row["loss"], row["lr"]) for row in rows if row["step"] != 3} == expected
    assert skipping.state.skipped == [3]
    assert skipping.loader.state_dict() == reference.loader.state_dict()
    steps_taken = {s["step"].item() for s in skipping.engine.optimizer.state.values()}
    assert steps_taken == {4.0}  # AdamW stepped at 1, 2, 4 and 5


def test_skip_nonfinite_stops_past_its_budget(tmp_path) -> None:
    config = tiny_config(tmp_path, steps=5, skip_nonfinite=1)
    config.checkpoint.enable, config.checkpoint.interval = True, 3
    trainer = Trainer(config, runtime=CPU)
    poison_steps(trainer, {2, 4})
    stopped = (
        "step 4: loss nan / grad norm nan is not finite; the update was not applied and "
        "training stopped after skipping steps 2 (training.skip_nonfinite 1)"
    )
    with pytest.raises(NonFiniteError, match=re.escape(stopped)):
        trainer.train()
    assert trainer.state.skipped == [2]
    steps_taken = {s["step"].item() for s in trainer.engine.optimizer.state.values()}
    assert steps_taken == {2.0}  # steps 1 and 3; neither 2 nor 4
    resumed = Trainer(config, runtime=CPU)  # the budget spent stays spent
    assert resumed.state.step == 3 and resumed.state.skipped == [2]


def test_accumulation_equals_the_big_batch_run(tmp_path) -> None:
    """4 sequences per step as 1 x 4 or as 2 x 2 accumulated: the same training run."""
    big = Trainer(tiny_config(tmp_path / "big", local_batch_size=4), runtime=CPU)
    big.train()
    acc = Trainer(
        tiny_config(tmp_path / "acc", local_batch_size=2, global_batch_size=4), runtime=CPU
    )
    assert acc.grad_accum == 2
    acc.train()
    rows = [
        [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("big", "acc")
    ]
    assert [r["step"] for r in rows[1]] == [1, 2, 3]
    for a, b in zip(*rows, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


def test_deterministic_flag_switches_torch_to_deterministic_kernels(tmp_path) -> None:
    """CPU fp32 training repeats bitwise with or without the flag, so repeating a run cannot
    tell them apart. What the flag must do is put torch in deterministic mode, where an op
    without a deterministic kernel (put_ onto a repeated index) refuses to run instead of
    giving an order-dependent result, and fix cuBLAS's workspace, which CUDA needs to repeat."""

    def put_twice_at_one_index() -> None:
        torch.zeros(3).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))

    Trainer(tiny_config(tmp_path / "off"), runtime=CPU)
    put_twice_at_one_index()
    try:
        Trainer(tiny_config(tmp_path / "on", deterministic=True), runtime=CPU)
        with pytest.raises(RuntimeError, match="does not have a deterministic implementation"):
            put_twice_at_one_index()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(False)
