"""The Engine API on one process: a user loop's step, HF-named weights out, save and load
with the loop's own state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from temper.config import Checkpoint, Config, Job, LoRA, Metrics, Model, Training
from temper.engine import Engine
from temper.models import save_hf
from temper.models.lora import merge_lora
from temper.objectives.causal_lm import label_log_probs
from temper.utils.device import Runtime

CPU = Runtime(device=torch.device("cpu"), rank=0, local_rank=0, world_size=1)


def config(tmp_path: Path, **sections: Any) -> Config:
    return Config(
        job=Job(dump_folder=str(tmp_path)),
        training=Training(steps=4, seq_len=16, local_batch_size=2),
        metrics=Metrics(tensorboard=False),
        **sections,
    )


def user_step(engine: Engine, seed: int) -> dict[str, torch.Tensor]:
    """What a user's loop does: a loss from engine.model over its count, backward, step."""
    ids = torch.randint(0, 600, (2, 17), generator=torch.Generator().manual_seed(seed))
    batch = engine.prepare_batch({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    with engine.autocast():
        loss = -label_log_probs(engine.model, batch["input_ids"], batch["labels"]).mean()
    loss.backward()
    return engine.step(loss)


def test_step_applies_the_update_and_reports_norm_and_lr(tmp_path: Path) -> None:
    engine = Engine(config(tmp_path), CPU)
    before = [p.detach().clone() for p in engine.model.parameters()]
    stats = user_step(engine, seed=0)
    grads_cleared = all(p.grad is None for p in engine.model.parameters())
    assert grads_cleared and stats["grad_norm"] > 0
    peak, warmup = engine.config.optimizer.lr, engine.config.lr_scheduler.warmup_steps
    assert stats["lr"].item() == pytest.approx(peak / warmup)  # warmup's first step
    stats = user_step(engine, seed=1)
    assert stats["lr"].item() == pytest.approx(2 * peak / warmup)
    moved = [not torch.equal(a, b) for a, b in zip(before, engine.model.parameters(), strict=True)]
    assert all(moved)


def test_step_runs_the_models_post_step_hook(tmp_path: Path) -> None:
    """DeepSeek V3's expert-bias balancing runs after the optimizer step: the routers'
    load counts of the step are consumed (zeroed) and the biases moved."""
    engine = Engine(config(tmp_path, model=Model(name="deepseek_v3", flavor="debug")), CPU)
    routers = [m for m in engine.model.modules() if hasattr(m, "expert_bias")]
    user_step(engine, seed=0)
    assert all(r.load.sum() == 0 for r in routers)
    assert any(r.expert_bias.abs().sum() > 0 for r in routers)


def test_hf_state_dict_equals_the_merged_export(tmp_path: Path) -> None:
    lora = LoRA(enable=True, rank=4, alpha=8.0)
    engine = Engine(config(tmp_path, lora=lora), CPU)
    for module in engine.model.modules():  # adapters start at B = 0: make them count
        if hasattr(module, "lora_b"):
            torch.nn.init.normal_(module.lora_b, std=0.1)
    pairs = engine.hf_state_dict()
    first = next(pairs)  # a lazy iterator: one tensor at a time
    streamed = dict([first, *pairs])
    save_hf(merge_lora(engine.model), tmp_path / "hf")
    exported = {}
    for shard in sorted((tmp_path / "hf").glob("*.safetensors")):
        exported |= load_file(shard)
    assert streamed.keys() == exported.keys()
    for name, tensor in exported.items():
        torch.testing.assert_close(streamed[name], tensor, rtol=0, atol=0)


class Counter:
    """A loop's own Stateful: a number and a tensor."""

    def __init__(self) -> None:
        self.value = 0
        self.history = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "history": self.history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value, self.history = state["value"], state["history"]


def test_save_and_load_carry_the_loops_state(tmp_path: Path) -> None:
    cfg = config(tmp_path, checkpoint=Checkpoint(enable=True))
    engine = Engine(cfg, CPU)
    assert engine.load(Counter()) is None  # nothing to resume yet
    user_step(engine, seed=0)
    counter = Counter()
    counter.value, counter.history = 7, torch.tensor([1.0, 2.0, 3.0])
    engine.save(1, counter, wait=True)
    want = user_step(engine, seed=1)

    again = Engine(cfg, CPU)
    restored = Counter()
    assert again.load(restored) == 1
    assert restored.value == 7 and torch.equal(restored.history, torch.tensor([1.0, 2.0, 3.0]))
    got = user_step(again, seed=1)  # the same step 2 as the run that went on
    assert torch.equal(got["grad_norm"], want["grad_norm"])
    for a, b in zip(again.model.parameters(), engine.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
