"""The rollout against the loss: its old log-probabilities are what the first update's forward
computes, to the bit, in fp32 and in bf16 (the ratio is exactly 1), and the rollout buffer is
train state that a checkpoint carries."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from temper.config import Config
from temper.data.batch import IGNORE_INDEX
from temper.objectives.causal_lm import label_log_probs
from temper.recipes.posttrain import grpo_debug


def _config(folder: Path, dtype: str = "float32") -> Config:
    config = grpo_debug()
    config.job.dump_folder = str(folder)
    config.checkpoint.initial_recipe = None
    config.metrics.tensorboard = False
    config.training.dtype = dtype
    config.lora.enable = False  # a plain head: the loss takes the fused, chunked path
    config.training.steps = 2
    config.training.seq_len = 32
    config.training.local_batch_size = 2
    config.training.global_batch_size = 2
    config.objective.group_size = 2
    config.objective.max_new_tokens = 8
    return config


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_first_update_is_on_policy_to_the_bit(tmp_path: Path, dtype: str) -> None:
    """The trainer's rollout records the log-probabilities the loss's own forward gives the
    same rows in the same precision: exp(logp - old) is exactly 1 on every completion token."""
    from temper.trainer import Trainer

    trainer = Trainer(_config(tmp_path, dtype))
    (batch,), _ = trainer._next_batches(iter(trainer.loader))
    engine, objective = trainer.engine, trainer.objective
    with engine.autocast():
        log_probs = label_log_probs(
            engine.model,
            batch["input_ids"],
            batch["labels"],
            temperature=objective.loss_temperature,
        )
    completion = batch["labels"] != IGNORE_INDEX
    assert completion.sum() > 0
    ratio = torch.exp(log_probs.detach() - batch["old_log_probs"])[completion]
    assert torch.equal(ratio, torch.ones_like(ratio))
