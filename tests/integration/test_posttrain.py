"""The post-training recipes learn: held-out scores after a short run beat those before."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from temper.config import load_config
from temper.data.batch import IGNORE_INDEX
from temper.recipes.posttrain import dpo_reward_scores, sft_scores
from temper.trainer.trainer import Trainer

pytestmark = pytest.mark.slow


def _trainer(recipe: str, folder: Path, *flags: str) -> Trainer:
    argv = ["--job.dump_folder", str(folder), "--metrics.no_tensorboard", *flags]
    return Trainer(load_config("temper.recipes.posttrain", recipe, argv))


def test_sft_improves_held_out_accuracy(tmp_path: Path) -> None:
    trainer = _trainer("sft_debug", tmp_path, "--training.steps", "30")
    before = sft_scores(trainer, count=64)
    trainer.train()
    after = sft_scores(trainer, count=64)
    assert after["token_accuracy"] > before["token_accuracy"] + 0.2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert rows[-1]["data_truncated"] == rows[-1]["data_dropped"] == 0


def test_dpo_improves_held_out_reward_margin(tmp_path: Path) -> None:
    sft = _trainer("sft_debug", tmp_path / "sft", "--checkpoint.enable")
    sft.train()
    start = tmp_path / "sft" / "checkpoints" / f"step-{sft.config.training.steps}"
    trainer = _trainer("dpo_debug", tmp_path / "dpo", "--checkpoint.initial_load", str(start))
    before = dpo_reward_scores(trainer, count=128)
    trainer.train()
    after = dpo_reward_scores(trainer, count=128)
    # At the start the policy is its reference, so every reward is 0; that reference is the
    # SFT model, which ranks the pairs well above the 0.5 of a random init.
    assert before["reward_margin"] == before["reward_accuracy"] == 0
    assert before["policy_prefers_chosen"] > 0.6
    # An update that learned nothing gives accuracy 0.5 (sd 0.044 over 128 pairs) and a margin
    # near 0; the recipe measures about 0.7 and 0.9 (beta 1, so the margin is in nats).
    assert after["reward_accuracy"] > 0.62
    assert after["reward_margin"] > 0.5
    # The policy's own ranking, without the reference, does not get worse.
    assert after["policy_prefers_chosen"] >= before["policy_prefers_chosen"] - 0.05


def _first_batch(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The batch the run's first step will train on (the loader's position is put back)."""
    position = trainer.loader.state_dict()
    batch = next(iter(trainer.loader))
    trainer.loader.load_state_dict(position)
    return batch


def _trained_text(trainer: Trainer, labels: torch.Tensor) -> str:
    return trainer.engine.tokenizer.decode(labels[labels != IGNORE_INDEX].tolist())


def test_user_jsonl_files(tmp_path: Path) -> None:
    """A user's chat and preference files are what the runs train on: SFT trains on the
    assistant's answer alone, with the initial model's cross-entropy on it (computed here) as
    its first loss; DPO's pair is the file's, with log 2 as its first loss (the policy equals
    its reference until the first update)."""
    chat = tmp_path / "chat.jsonl"
    record = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    }
    chat.write_text(json.dumps(record) + "\n")
    trainer = _trainer(
        "sft_debug", tmp_path / "sft", "--data.path", str(chat), "--training.steps", "2",
        "--training.local_batch_size", "2", "--data.no_pack",
    )  # fmt: skip
    batch = _first_batch(trainer)
    assert [_trained_text(trainer, row) for row in batch["labels"]] == ["yo<|end|>\n"] * 2
    with torch.no_grad():
        logits = trainer.engine.model(batch["input_ids"])
    expected = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").open()]
    assert rows[0]["loss"] == pytest.approx(expected.item(), rel=1e-5)

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "hi", "chosen": "yo", "rejected": "no"}) + "\n")
    trainer = _trainer(
        "dpo_debug", tmp_path / "dpo", "--data.path", str(pairs), "--training.steps", "2",
        "--training.local_batch_size", "1",
    )  # fmt: skip
    batch = _first_batch(trainer)
    assert _trained_text(trainer, batch["chosen_labels"][0]) == "yo<|end|>\n"
    assert _trained_text(trainer, batch["rejected_labels"][0]) == "no<|end|>\n"
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "dpo" / "metrics.jsonl").open()]
    assert rows[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert rows[1]["loss"] != rows[0]["loss"]  # the first update moved the policy
    pairs.write_text('{"prompt": "hi", "chosen": "yo"}\n')
    # Records are parsed when a rank reads them (the pre-flight checks the first ones before
    # launch): the first batch fails naming the file and line.
    with pytest.raises(ValueError, match=f"{pairs}:1: record has no field 'rejected'"):
        _trainer("dpo_debug", tmp_path / "bad", "--data.path", str(pairs)).train()
