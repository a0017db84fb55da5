"""The post-training recipes learn: held-out scores after a short run beat those before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from temper.config import load_config
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


def test_user_jsonl_files(tmp_path: Path) -> None:
    chat = tmp_path / "chat.jsonl"
    record = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    }
    chat.write_text(json.dumps(record) + "\n")
    trainer = _trainer(
        "sft_debug", tmp_path / "sft", "--data.path", str(chat), "--training.steps", "2",
        "--training.local_batch_size", "2", "--data.no_pack",
    )  # fmt: skip
    trainer.train()
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "hi", "chosen": "yo", "rejected": "no"}) + "\n")
    trainer = _trainer(
        "dpo_debug", tmp_path / "dpo", "--data.path", str(pairs), "--training.steps", "2",
        "--training.local_batch_size", "1",
    )  # fmt: skip
    trainer.train()
    pairs.write_text('{"prompt": "hi", "chosen": "yo"}\n')
    # Records are parsed when a rank reads them (the pre-flight checks the first ones before
    # launch): the first batch fails naming the file and line.
    with pytest.raises(ValueError, match=f"{pairs}:1: record has no field 'rejected'"):
        _trainer("dpo_debug", tmp_path / "bad", "--data.path", str(pairs)).train()
