"""Optimizer offload against the run that never offloaded: same next step, refused misuse."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from temper.config import Config, Job, Metrics, Training
from temper.optim import OptimizerOffload, OptimizerOffloadedError
from temper.optim import offload as offload_module
from temper.trainer.trainer import Trainer


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    model(x).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_offload_restore_keeps_the_next_step_and_refuses_misuse() -> None:
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for model, optimizer in zip(models, optimizers, strict=True):
        _step(model, optimizer, seed=1)

    offload = OptimizerOffload(optimizers[1])
    state = optimizers[1].state[models[1][0].weight]
    before = {k: v.clone() for k, v in state.items()}
    original = state["exp_avg"]
    offload.offload()
    offload.offload()  # idempotent
    # A fresh CPU copy took the state's place: the original tensor is no longer held.
    assert state["exp_avg"] is not original and state["exp_avg"].device.type == "cpu"
    torch.testing.assert_close(state["exp_avg"], before["exp_avg"], rtol=0, atol=0)
    with pytest.raises(OptimizerOffloadedError, match="cannot step: .* restore_optimizer"):
        optimizers[1].step()
    with pytest.raises(OptimizerOffloadedError, match="cannot save its state"):
        optimizers[1].state_dict()
    offload.restore()
    offload.restore()
    for key, value in optimizers[1].state[models[1][0].weight].items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)

    for model, optimizer in zip(models, optimizers, strict=True):
        _step(model, optimizer, seed=2)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_restore_returns_each_tensor_to_its_own_device() -> None:
    """On a CPU machine the state's home is the CPU too, so the round trip above cannot tell
    a restore that moves a tensor home from one that leaves it on the CPU. Here the home is
    the meta device, a stand-in for a GPU: what offload records of a tensor rebuilds the CPU
    copy there, with its shape and dtype, and a CPU home stays on the CPU."""
    on_device = torch.empty(3, 5, dtype=torch.bfloat16, device="meta")
    cpu_copy = torch.zeros(3, 5, dtype=torch.bfloat16)
    back = offload_module._rebuild(cpu_copy, offload_module._home(on_device))
    assert back.device == torch.device("meta")
    assert back.shape == on_device.shape and back.dtype == on_device.dtype
    on_cpu = torch.ones(2)
    assert offload_module._rebuild(on_cpu, offload_module._home(on_cpu)).device.type == "cpu"


def test_trainer_offload_between_steps_changes_nothing(tmp_path) -> None:
    def trainer(name: str) -> Trainer:
        config = Config(
            job=Job(dump_folder=str(tmp_path / name)),
            training=Training(steps=2, seq_len=32, local_batch_size=2),
            metrics=Metrics(tensorboard=False),
        )
        return Trainer(config)

    plain, offloaded = trainer("plain"), trainer("offloaded")
    batch = {k: v for k, v in next(iter(plain.loader)).items()}
    plain.train_step([batch])
    offloaded.train_step([batch])
    offloaded.offload_optimizer()
    with pytest.raises(OptimizerOffloadedError, match="cannot step"):
        offloaded.train_step([batch])  # refused before any work: step and gradients unchanged
    assert offloaded.state.step == 1
    offloaded.restore_optimizer()
    want = plain.train_step([batch])
    got = offloaded.train_step([batch])
    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    for a, b in zip(
        plain.engine.model.parameters(), offloaded.engine.model.parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
