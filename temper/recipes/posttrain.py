"""Post-training recipes on the built-in chat tasks, and their held-out evaluation.

    MODULE=temper.recipes.posttrain CONFIG=sft_debug ./run_train.sh
    python -m temper.recipes.posttrain sft_debug     # train, with held-out scores before/after

SFT is scored by exact match: the teacher-forced argmax of every answer token (and the
closing ``<|end|>``) must equal the answer. DPO is scored by the held-out reward accuracy and
margin of the trained policy against its reference.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from temper.config import (
    Checkpoint,
    Config,
    Data,
    Job,
    LoRA,
    LRScheduler,
    Model,
    Optimizer,
    Training,
)
from temper.data.batch import IGNORE_INDEX
from temper.data.chat import BUILTIN_TEMPLATE, render_chat, stop_token_ids
from temper.data.loader import BatchLoader
from temper.data.preference import preference_dataset
from temper.data.sft import sft_dataset
from temper.data.tasks import preference_pairs, sft_conversations, task_prompts
from temper.generation.evaluate import greedy_answers
from temper.objectives.dpo import DPOConfig, sequence_log_probs
from temper.objectives.grpo import GRPOConfig
from temper.objectives.rewards import exact_match
from temper.recipes.shapes import debug_sft

if TYPE_CHECKING:
    from temper.trainer.trainer import Trainer

EVAL_EXAMPLES = 256


def sft_debug() -> Config:
    """Chat SFT of a random-init debug Llama on the built-in copy/sort tasks (CPU, minutes)."""
    return debug_sft("sft_debug", Model(name="llama3", flavor="debug"), Data(format="sft"))


def dpo_debug() -> Config:
    """DPO with LoRA on the built-in preference pairs (correct vs one-item-wrong answers).

    Expects an sft_debug checkpoint (--checkpoint.initial_load <run>/checkpoints/step-60):
    DPO sharpens the ranking the start already has. From that 60-step SFT model, held-out
    sort pairs reach ~0.9 reward accuracy while copy pairs, which the SFT model ranks at
    chance, stay near 0.5, so the overall accuracy is ~0.7. From a random init (no
    initial_load) it still learns part of sort (accuracy ~0.65, margin ~0.4) against a
    random reference. beta is 1, not 0.1: the answers differ in one item, so a few nats
    separate a pair and the loss should stop there; at beta 0.1 it kept lowering both
    answers' log-probabilities and the held-out accuracy fell back toward chance.
    """
    return Config(
        job=Job(dump_folder="./outputs/dpo_debug"),
        model=Model(name="llama3", flavor="debug"),
        training=Training(steps=40, seq_len=48, local_batch_size=16),
        optimizer=Optimizer(lr=1e-3, weight_decay=0.0),
        lr_scheduler=LRScheduler(warmup_steps=5, decay="cosine", min_lr_ratio=0.1),
        data=Data(format="preference"),
        objective=DPOConfig(beta=1.0),
        lora=LoRA(enable=True, rank=8, alpha=16.0),
    )


def grpo_debug() -> Config:
    """GRPO with LoRA on the built-in copy/sort prompts, rewarded by exact match.

    ``--checkpoint.initial_load`` names the SFT start; without one the run first trains
    sft_debug for 300 steps of 16 (into <dump_folder>/initial), so it works on a fresh
    checkout. That start answers about half the held-out prompts right by greedy decoding,
    and a sample of 8 at temperature 1 holds a right answer far more often (pass@8 0.41 on
    copy, 0.97 on sort): the room GRPO sharpens into. LoRA, not full fine-tuning: with
    every weight free, 30-150 steps fitted each step's prompts and left held-out accuracy
    flat or lower; the rank-8 adapters move the policy only in directions many prompts
    share. Temperature 1 samples the policy itself, so the groups hold its real mistakes.
    """
    return Config(
        job=Job(dump_folder="./outputs/grpo_debug"),
        model=Model(name="llama3", flavor="debug"),
        training=Training(steps=200, seq_len=48, local_batch_size=16),
        optimizer=Optimizer(lr=1e-3, weight_decay=0.0),
        lr_scheduler=LRScheduler(warmup_steps=0, decay="linear", min_lr_ratio=1.0),
        data=Data(format="prompt"),
        objective=GRPOConfig(
            group_size=8,
            max_new_tokens=16,
            temperature=1.0,
            rewards=["exact_match"],
            loss="dapo",  # the token-level mean this recipe was tuned with (once named grpo)
        ),
        lora=LoRA(enable=True, rank=8, alpha=16.0),
        checkpoint=Checkpoint(
            initial_recipe=(
                "temper.recipes.posttrain:sft_debug"
                " --training.steps 300 --training.local_batch_size 16"
            )
        ),
    )


def grpo_moe_debug() -> Config:
    """GRPO on the Qwen3-MoE debug model, for RL on expert and sequence parallel layouts.

    Every weight trains (the routed experts too), from a 30-step SFT start of the same model,
    rewarded with partial credit (``item_match``) and the answer form, which that start earns.
    ``NGPU=4 ... --parallelism.ep 2`` or ``--parallelism.sp 2`` give one process's rollouts and
    losses at the same global batch (``--training.local_batch_size`` times the data-parallel
    ranks; docs/post-training.md)."""
    return replace(
        grpo_debug(),
        job=Job(dump_folder="./outputs/grpo_moe_debug"),
        model=Model(name="qwen3_moe", flavor="debug"),
        optimizer=Optimizer(lr=1e-4, weight_decay=0.0),
        objective=GRPOConfig(
            group_size=8,
            max_new_tokens=16,
            temperature=1.0,
            rewards=["item_match", "format"],
            loss="dapo",
        ),
        lora=LoRA(),
        checkpoint=Checkpoint(
            initial_recipe=(
                "temper.recipes.posttrain:sft_debug --model.name qwen3_moe"
                " --training.steps 30 --training.local_batch_size 16"
            )
        ),
    )


@torch.no_grad()
def greedy_scores(trainer: Trainer, count: int = EVAL_EXAMPLES) -> dict[str, float]:
    """Held-out exact match of the greedy answers to the built-in tasks' prompts."""
    config = trainer.config
    template = BUILTIN_TEMPLATE
    records = task_prompts(config.training.seed, "eval", count)
    tokenizer = trainer.engine.tokenizer
    prompts = [
        tokenizer.encode(render_chat(template, messages, True, **tokenizer.special_tokens))
        for messages, _ in records
    ]
    answers = greedy_answers(
        trainer.engine.model,
        prompts,
        trainer.engine.tokenizer.decode,
        max_new_tokens=config.objective.max_new_tokens,
        stop_tokens=stop_token_ids(trainer.engine.tokenizer, template),
    )
    hits = [exact_match("", got, record) for got, (_, record) in zip(answers, records, strict=True)]
    return {"exact_match": sum(hits) / len(hits)}


@torch.no_grad()
def sft_scores(trainer: Trainer, count: int = EVAL_EXAMPLES) -> dict[str, float]:
    """Held-out exact match (every trained token is the argmax) and trained-token accuracy."""
    config = trainer.config
    dataset = sft_dataset(
        sft_conversations(config.training.seed, "eval", count),
        trainer.engine.tokenizer,
        BUILTIN_TEMPLATE,
        config.training.seq_len,
        pack=False,
        seed=0,
    )
    trainer.engine.model.eval()
    exact = right = tokens = 0
    batches = iter(BatchLoader(dataset, 32))
    for _ in range(count // 32):
        batch = _to(next(batches), trainer.engine.device)
        hits = trainer.engine.model(batch["input_ids"]).argmax(-1) == batch["labels"]
        trained = batch["labels"] != IGNORE_INDEX
        exact += int((hits | ~trained).all(-1).sum())
        right += int((hits & trained).sum())
        tokens += int(trained.sum())
    trainer.engine.model.train()
    return {"exact_match": exact / (count // 32 * 32), "token_accuracy": right / tokens}


@torch.no_grad()
def dpo_reward_scores(trainer: Trainer, count: int = EVAL_EXAMPLES) -> dict[str, float]:
    """Held-out DPO metrics (reward accuracy, margin) of the policy against its reference, and
    how often the policy alone gives the chosen answer the higher log-probability."""
    config = trainer.config
    dataset = preference_dataset(
        preference_pairs(config.training.seed, "eval", count),
        trainer.engine.tokenizer,
        BUILTIN_TEMPLATE,
        config.training.seq_len,
        seed=0,
    )
    trainer.engine.model.eval()
    totals: dict[str, float] = {}
    batches = iter(BatchLoader(dataset, 32))
    n = count // 32
    for _ in range(n):
        batch = _to(next(batches), trainer.engine.device)
        _, _, metrics = trainer.objective.loss(trainer.engine.model, batch)
        # The policy's own preference, without the reference: log p(chosen) > log p(rejected).
        chosen = sequence_log_probs(
            trainer.engine.model, batch["chosen_input_ids"], batch["chosen_labels"]
        )
        rejected = sequence_log_probs(
            trainer.engine.model, batch["rejected_input_ids"], batch["rejected_labels"]
        )
        metrics["policy_prefers_chosen"] = (chosen > rejected).float().mean().item()
        for name, value in metrics.items():
            totals[name] = totals.get(name, 0.0) + value / n
    trainer.engine.model.train()
    return totals


def _to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def main(argv: list[str]) -> None:
    """Train a recipe of this module with held-out scores before and after."""
    from temper.config import load_config
    from temper.trainer.trainer import Trainer

    trainer = Trainer(load_config("temper.recipes.posttrain", argv[0], argv[1:]))
    score = {"causal_lm": sft_scores, "dpo": dpo_reward_scores, "grpo": greedy_scores}[
        trainer.config.objective.name
    ]
    before = score(trainer)
    trainer.train()
    after = score(trainer)
    print(f"held-out {score.__name__}: before {before}, after {after}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
