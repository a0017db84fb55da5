"""Validation during training: a held-out loss and a generation check that leave the
training run untouched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from temper.config import Config, Job, LRScheduler, Metrics, Model, Training, Validation
from temper.data.chat import BUILTIN_TEMPLATE, render_chat, stop_token_ids
from temper.data.loader import build_validation_loader, validation_prompts
from temper.data.tasks import sft_conversations
from temper.generation.evaluate import greedy_answers
from temper.trainer import Trainer
from temper.utils.device import Runtime

pytestmark = pytest.mark.slow  # two short training runs

CPU = Runtime(device=torch.device("cpu"), rank=0, local_rank=0, world_size=1)
CONVERSATIONS = sft_conversations(3, "train", 40)


def _config(folder: Path, data: Path, interval: int) -> Config:
    config = Config(
        job=Job(dump_folder=str(folder)),
        model=Model(name="llama3", flavor="debug"),
        training=Training(steps=3, seq_len=32, local_batch_size=2, deterministic=True),
        lr_scheduler=LRScheduler(warmup_steps=1),
        metrics=Metrics(tensorboard=False),
        validation=Validation(
            interval=interval, fraction=0.25, steps=2, generate=4, max_new_tokens=8
        ),
    )
    config.data.path = str(data)
    config.data.format = "sft"
    config.data.pack = False
    return config


def _rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_validation_leaves_training_alone_and_measures_held_out_records(tmp_path: Path) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    Trainer(_config(tmp_path / "plain", data, interval=0), runtime=CPU).train()
    trainer = Trainer(_config(tmp_path / "validated", data, interval=2), runtime=CPU)
    trainer.train()
    rows, reference = _rows(tmp_path / "validated"), _rows(tmp_path / "plain")
    assert [r["loss"] for r in rows] == [r["loss"] for r in reference]  # bitwise
    assert [r["grad_norm"] for r in rows] == [r["grad_norm"] for r in reference]
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 3]  # every 2 steps, and the last
    assert "val_loss" not in reference[-1] and "val_exact_match" in rows[-1]

    # The held-out quarter (conversations 30..39) trains nowhere; the last val_loss is the
    # mean loss of its first 2 global batches under the final weights, computed here by hand.
    config, engine = trainer.config, trainer.engine
    assert trainer.loader.dataset.sources[0].num_records == 30
    loader = build_validation_loader(config, engine.tokenizer, 0, 1)
    assert loader.dataset.sources[0].record(0) == {"messages": CONVERSATIONS[30]}
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

    # The generation check: the first 4 held-out conversations without their answers, shared
    # out over ranks; val_exact_match is their greedy answers' exact match, here again.
    tokenizer = engine.tokenizer
    prompts = validation_prompts(config, tokenizer, 0, 1)
    held_out = CONVERSATIONS[30:34]
    assert [record["answer"] for _, record in prompts] == [c[1]["content"] for c in held_out]
    for (ids, _), conversation in zip(prompts, held_out, strict=True):
        text = render_chat(BUILTIN_TEMPLATE, conversation[:1], True, **tokenizer.special_tokens)
        assert ids == tokenizer.encode(text)
    second_rank = validation_prompts(config, tokenizer, 1, 2)
    assert [r["answer"] for _, r in second_rank] == [c[1]["content"] for c in held_out[1::2]]
    answers = greedy_answers(
        engine.model,
        [ids for ids, _ in prompts],
        tokenizer.decode,
        max_new_tokens=8,
        stop_tokens=stop_token_ids(tokenizer, BUILTIN_TEMPLATE),
    )
    hits = [
        got.strip() == record["answer"].strip()
        for got, (_, record) in zip(answers, prompts, strict=True)
    ]
    assert rows[-1]["val_exact_match"] == pytest.approx(sum(hits) / 4)
