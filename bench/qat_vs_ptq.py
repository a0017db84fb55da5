"""Held-out greedy exact match of an SFT run quantized to int4: with QAT against post-training
quantization (PTQ) of the same run without QAT.

    python -m bench.qat_vs_ptq                      # sft_debug, 100 steps of 8, 128 prompts
    python -m bench.qat_vs_ptq --steps 300 --batch 16 --count 256 --seed 1

Two runs of the ``sft_debug`` recipe from the same seed and data: one plain, one with
``--qat.enable`` (int4 weights per group of 32, int8 per-token activations). Each is scored
on the built-in tasks' held-out prompts (greedy decoding, the answer must be exact, as
scripts/evaluate.py scores): the plain run in fp32 and after PTQ
(``quantize_for_inference`` on its weights), the QAT run after the same conversion. Prints a
markdown table. The default run takes about 7 CPU-minutes (both trainings and the three
scorings).
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Sequence

import torch
from torch import nn

from temper.config import Config, load_config
from temper.data.chat import load_chat_template, render_chat, stop_token_ids
from temper.data.tasks import task_prompts
from temper.generation.evaluate import greedy_answers
from temper.objectives.rewards import exact_match
from temper.quantize import quantize_for_inference
from temper.trainer import Trainer


def exact_match_rate(model: nn.Module, trainer: Trainer, count: int, seed: int) -> float:
    tokenizer = trainer.engine.tokenizer
    template = load_chat_template(None, None)
    records = task_prompts(seed, "eval", count)
    prompts = [
        tokenizer.encode(render_chat(template, messages, True, **tokenizer.special_tokens))
        for messages, _ in records
    ]
    answers = greedy_answers(
        model,
        prompts,
        tokenizer.decode,
        max_new_tokens=32,
        stop_tokens=stop_token_ids(tokenizer, template),
    )
    hits = [exact_match("", got, want) for got, (_, want) in zip(answers, records, strict=True)]
    return sum(hits) / len(hits)


def run(argv: list[str]) -> Trainer:
    config: Config = load_config("temper.recipes.posttrain", "sft_debug", argv)
    trainer = Trainer(config)
    trainer.train()
    return trainer


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.qat_vs_ptq", description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=128, help="held-out prompts")
    parser.add_argument("--dump", default="./outputs/qat_vs_ptq")
    args = parser.parse_args(argv)
    common = [
        "--training.steps", str(args.steps),
        "--training.local_batch_size", str(args.batch),
        "--training.seed", str(args.seed),
        "--metrics.no-tensorboard",
        "--metrics.log_freq", "50",
    ]  # fmt: skip
    plain = run([*common, "--job.dump_folder", f"{args.dump}/plain"])
    qat = run([*common, "--job.dump_folder", f"{args.dump}/qat", "--qat.enable"])
    scheme = qat.config.qat
    plain_model = plain.engine.model.eval()
    with torch.no_grad():
        rows = [
            ("no QAT, fp32", exact_match_rate(plain_model, plain, args.count, args.seed)),
            (
                "no QAT, int4 (PTQ)",
                exact_match_rate(
                    quantize_for_inference(copy.deepcopy(plain_model), scheme),
                    plain,
                    args.count,
                    args.seed,
                ),
            ),
            (
                "QAT, int4",
                exact_match_rate(
                    quantize_for_inference(qat.engine.model.eval(), scheme),
                    qat,
                    args.count,
                    args.seed,
                ),
            ),
        ]
    print(f"\n| sft_debug, {args.steps} steps of {args.batch}, seed {args.seed} | exact match |")
    print("| --- | --- |")
    for name, rate in rows:
        print(f"| {name} | {rate:.3f} ({round(rate * args.count)}/{args.count}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
