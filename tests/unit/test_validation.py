"""Validation during training: a held-out loss that leaves the training run untouched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from temper.config import Config, Job, LRScheduler, Metrics, Model, Training, Validation
from temper.data.loader import build_validation_loader
from temper.trainer import Trainer
from temper.utils.device import Runtime

pytestmark = pytest.mark.slow  # two short training runs

CPU = Runtime(device=torch.device("cpu"), rank=0, local_rank=0, world_size=1)


def _config(folder: Path, data: Path, interval: int) -> Config:
    config = Config(
        job=Job(dump_folder=str(folder)),
        model=Model(name="llama3", flavor="debug"),
        training=Training(steps=3, seq_len=16, local_batch_size=2, deterministic=True),
        lr_scheduler=LRScheduler(warmup_steps=1),
        metrics=Metrics(tensorboard=False),
        validation=Validation(interval=interval, fraction=0.25, steps=2),
    )
    config.data.path = str(data)
    return config


def _rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_validation_leaves_training_alone_and_is_the_held_out_mean_loss(tmp_path: Path) -> None:
    data = tmp_path / "docs.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"document {i} " * (i % 5 + 1)}) + "\n" for i in range(40))
    )
    plain = Trainer(_config(tmp_path / "plain", data, interval=0), runtime=CPU)
    plain.train()
    validated = Trainer(_config(tmp_path / "validated", data, interval=2), runtime=CPU)
    validated.train()
    rows, reference = _rows(tmp_path / "validated"), _rows(tmp_path / "plain")
    assert [r["loss"] for r in rows] == [r["loss"] for r in reference]  # bitwise
    assert [r["grad_norm"] for r in rows] == [r["grad_norm"] for r in reference]
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 3]  # every 2 steps, and the last
    assert "val_loss" not in reference[-1]

    # The held-out quarter (records 30..39) trains nowhere; the last val_loss is the mean loss
    # of its first 2 global batches under the final weights, computed here by hand.
    assert validated.loader.dataset.sources[0].num_records == 30
    config, engine = validated.config, validated.engine
    loader = build_validation_loader(config, engine.tokenizer, 0, 1)
    assert loader.dataset.sources[0].record(0) == {"text": "document 30 "}
    total = count = 0.0
    engine.model.eval()
    with torch.no_grad():
        for batch, _ in zip(loader, range(2), strict=False):
            logits = engine.model(batch["input_ids"]).float()
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum"
            )
            total += float(loss)
            count += int((batch["labels"] != -100).sum())
    assert rows[-1]["val_loss"] == pytest.approx(total / count, rel=1e-5)
