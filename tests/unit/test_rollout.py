"""The rollout against the loss: its old log-probabilities are what the first update's forward
computes, to the bit, in fp32 and in bf16 (the ratio is exactly 1), so when the model itself
sampled and one update follows, the scoring forwards are skipped: the step's loss, gradients
and metrics equal those of the path that runs them, with fewer forwards."""

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
    """The old log-probabilities' forward (forced on) records what the loss's own forward
    gives the same rows in the same precision: exp(logp - old) is exactly 1 on every
    completion token, which is why it can be skipped."""
    from temper.trainer import Trainer

    trainer = Trainer(_config(tmp_path, dtype))
    trainer.objective.sampler.recompute_old = True
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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_skipping_the_redundant_forward_keeps_the_step(tmp_path: Path, dtype: str) -> None:
    """One sampled rollout scored twice: as the rollout did before (the old log-probs'
    forward run) and without it. The loss, every gradient and the metrics agree to 1e-6,
    and scoring runs no forward of the policy (before: one for the old log-probs and one for
    the entropy, now read from the training forward)."""
    from temper.trainer import Trainer

    trainer = Trainer(_config(tmp_path, dtype))
    engine, objective, model = trainer.engine, trainer.objective, trainer.engine.model
    prompts = {k: v.to(engine.device) for k, v in next(iter(trainer.loader)).items()}
    forwards = 0

    def count(*_: object) -> None:
        nonlocal forwards
        forwards += 1

    model.tok_embeddings.register_forward_pre_hook(count)  # once per decoder forward
    with engine.autocast(), torch.no_grad():
        sampled = objective.sample(model, prompts, torch.Generator().manual_seed(0), None)
    steps = {}
    for recompute in (True, False):
        objective.sampler.recompute_old = recompute
        forwards = 0
        with engine.autocast():
            batch, _ = objective.score(model, prompts, sampled)
        scoring = forwards
        # Rows as wide as the longest prompt + completion, not training.seq_len (32).
        assert (batch["labels"][:, -1] != IGNORE_INDEX).any()
        with engine.autocast():
            loss, count_, metrics = objective.loss(model, engine.prepare_batch(batch))
        (loss / count_).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        steps[recompute] = (scoring, forwards - scoring, loss.detach(), grads, metrics)
    (before, before_loss, *_), (now, now_loss, *_) = steps[True], steps[False]
    assert (before, before_loss) == (1, 1)  # the old log-probs' forward, then the loss's
    assert (now, now_loss) == (0, 1)
    _, _, loss_before, grads_before, metrics_before = steps[True]
    _, _, loss_now, grads_now, metrics_now = steps[False]
    torch.testing.assert_close(loss_now, loss_before, rtol=0, atol=1e-6)
    for got, want in zip(grads_now, grads_before, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert metrics_now.keys() == metrics_before.keys()
    for name, value in metrics_before.items():
        torch.testing.assert_close(metrics_now[name], value, rtol=0, atol=1e-6)


def test_the_console_line_shows_reward_kl_and_clip_fraction(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """GRPO's step line carries what shows learning (its loss is about 0 on an on-policy
    update): the reward mean, the KL to the reference and the clip fraction, as logged."""
    import json

    from temper.trainer import Trainer

    config = _config(tmp_path)
    config.training.steps = 1
    config.lora.enable = True  # the reference is the policy with its adapters off
    config.objective.kl_coef = 0.1
    Trainer(config).train()
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert row["kl"] >= 0 and 0 <= row["clip_fraction"] <= 1
    want = (
        f"loss {row['loss']:.4f}  reward_mean {row['reward_mean']:.3f}  "
        f"accuracy {row['accuracy']:.3f}  kl {row['kl']:.2e}  "
        f"clip_fraction {row['clip_fraction']:.3f}  grad_norm"
    )
    assert want in line
