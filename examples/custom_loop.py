"""REINFORCE on the built-in copy/sort prompts: a training loop of its own, written only
against ``temper.engine.Engine``.

    python examples/custom_loop.py --training.steps 20
    torchrun --nproc-per-node 2 examples/custom_loop.py --training.steps 20   # FSDP 2

Any ``--section.field`` of the sft_debug recipe applies (the model, optimizer, layout).
Each step the data ranks split ``PROMPTS`` prompts, sample ``GROUP`` completions of each,
reward the answer's characters in place, and raise the log-probability of the completions
that beat their group's mean. A prompt's sampler is seeded by the step and the prompt's
index, so one process and two draw the same completions, and print the same losses.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from temper.config import load_config
from temper.data.batch import IGNORE_INDEX
from temper.data.chat import BUILTIN_TEMPLATE, render_chat, stop_token_ids
from temper.data.tasks import task_prompts
from temper.engine import Engine
from temper.generation import generate
from temper.objectives.causal_lm import label_log_probs
from temper.objectives.rollout import rollout_rows

PROMPTS = 4
"""Prompts per step, over all data ranks."""
GROUP = 4
"""Completions sampled per prompt."""
MAX_NEW_TOKENS = 8


def main(argv: Sequence[str] = ()) -> list[float]:
    """Train; returns each step's loss (the same on every rank)."""
    engine = Engine(load_config("temper.recipes.posttrain", "sft_debug", argv))
    config, tokenizer, model = engine.config, engine.tokenizer, engine.model
    stops = stop_token_ids(tokenizer, BUILTIN_TEMPLATE)
    per_rank = PROMPTS // engine.dims.dp
    prompts = task_prompts(config.training.seed, "train", config.training.steps * PROMPTS)
    losses = []
    for step in range(config.training.steps):
        first = step * PROMPTS + engine.dims.dp_rank * per_rank
        records = prompts[first : first + per_rank]
        rows, completions, rewards = [], [], []
        model.eval()
        for index, (messages, record) in enumerate(records, start=first):
            chat = render_chat(BUILTIN_TEMPLATE, messages, add_generation_prompt=True)
            prompt = torch.tensor(tokenizer.encode(chat), device=engine.device)
            sampler = torch.Generator(engine.device).manual_seed(index)
            out = generate(
                model, [prompt] * GROUP, MAX_NEW_TOKENS, 1.0, stop_tokens=stops, generator=sampler
            )
            texts = out.texts(tokenizer.decode, stops)
            scores = torch.tensor([reward(text, record["answer"]) for text in texts])
            rows += [prompt] * GROUP
            completions.append(out)
            rewards.append(scores - scores.mean())
        model.train()
        tokens = torch.cat([out.tokens for out in completions])
        lengths = torch.cat([out.lengths for out in completions])
        input_ids, labels = rollout_rows(rows, tokens, lengths)
        advantages = torch.cat(rewards).to(engine.device)

        count = (labels != IGNORE_INDEX).sum().float()
        if dist.is_initialized():
            dist.all_reduce(count)
        with engine.autocast():
            log_probs = label_log_probs(model, input_ids, labels)
            loss_sum = -(advantages[:, None] * log_probs).sum()
        (loss_sum / count).backward()
        stats = engine.step()

        loss = loss_sum.detach()
        if dist.is_initialized():
            dist.all_reduce(loss)
        losses.append(float(loss / count))
        if engine.runtime.is_main:
            grad_norm = float(stats["grad_norm"])
            print(f"step {step + 1}: loss {losses[-1]:.6f} grad_norm {grad_norm:.4f}", flush=True)
    return losses


def reward(completion: str, answer: str) -> float:
    """The share of the answer's characters that the completion has in place: a dense
    reward, so that even a random policy's samples differ and the gradient is not zero."""
    hits = sum(a == b for a, b in zip(completion.strip(), answer, strict=False))
    return hits / max(len(answer), 1)


if __name__ == "__main__":
    main(sys.argv[1:])
    if dist.is_initialized():
        dist.destroy_process_group()
