"""Temper against TRL on the same model, data, template and loss mask, in one run.

    python -m bench.vs_trl                                   # full SFT, rows of 512 and 1024
    python -m bench.vs_trl --modes full,lora --seq-len 512,1024 --steps 5

One random Qwen3-shaped model is saved to a temp folder with the built-in tokenizer, and a
JSONL file of synthetic multi-turn chats (`conversations`: seeded, 60-540 tokens, median
258) beside it. Temper trains on the file as a run does (`Trainer` from the `sft_debug` recipe with
``--model.hf_path``, its default packing: best-fit decreasing over ``data.pack_buffer``
samples into rows of ``seq_len``, padded). TRL's `SFTTrainer` trains on the same
conversations tokenized by Temper's `tokenize_chat` (`trl_example`: the same ids, and labels
that train exactly the tokens Temper trains), with its default packing (``packing=True``:
best-fit decreasing over the whole data set, padding-free rows). Both use fp32, AdamW at
lr 1e-4 without weight decay (TRL's constant, Temper's its recipe's cosine decay: the rate does
not change a step's cost), grad-norm clipping at 1 and ``batch`` rows (TRL: packed sequences)
of ``seq_len`` per step; LoRA (``--modes lora``) is rank 8, alpha 16 on every
attention and MLP projection on both sides.

Both sides run at once, each in a fresh process (its peak memory is its own), and take turns
(`Turns`): after one warm-up step each, Temper takes a step while TRL waits, then TRL while
Temper waits, ``--steps`` rounds, so load from anything else on the shared machine falls on
both alike. A side's step time runs from getting the turn to the step's end, so it holds the
side's data loading and logging as well as the step. Per side: the median seconds per step;
tokens over the summed seconds, for real tokens (every non-padding position) and trained ones
(a label that counts); fill, the real tokens over ``batch * seq_len`` positions a step; peak
memory, the peak resident set over the timed steps (VmHWM, reset after the warm-up) minus the
resident set before the model was built. The ratios are Temper / TRL per round (their median
and range).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from bench.train_step import _peak_rss_gib, _rss_gib, run_sides
from temper.data.batch import IGNORE_INDEX, REAL_TOKENS
from temper.data.chat import BUILTIN_TEMPLATE, tokenize_chat

SIDES = ("temper", "trl")
LR = 1e-4
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Temper's default LoRA targets (every attention and MLP projection) by their HF names."""

QWEN3_SMALL = dict(
    model_type="qwen3",
    vocab_size=32000,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    tie_word_embeddings=True,
)
"""11M parameters, 8M of them the (tied) 32K embedding: a real vocabulary's LM head on a
model small enough for a few steps a side on two cores. The built-in tokenizer uses the first
688 ids."""

WORDS = (
    "the", "a", "model", "reads", "writes", "list", "numbers", "order", "answer", "question",
    "short", "long", "blue", "red", "green", "seven", "three", "nine", "cat", "dog", "tree",
    "river", "city", "table", "window", "light", "night", "morning", "because", "when",
    "after", "before", "small", "large", "quick", "slow", "first", "last", "every", "other",
    "sort", "copy", "count", "find", "keep",
)  # fmt: skip


def conversations(count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """``count`` chats of one to three user/assistant exchanges of seeded random words, some
    with a system turn: 60-540 tokens each with the built-in tokenizer and template (90% of
    them 100-430, median 258)."""
    rng = random.Random(seed)

    def text(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))

    chats = []
    for _ in range(count):
        chat = [{"role": "system", "content": text(3, 12)}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 3)):
            chat += [
                {"role": "user", "content": text(4, 18)},
                {"role": "assistant", "content": text(10, 32)},
            ]
        chats.append(chat)
    return chats


def trl_example(ids: list[int], trains: list[bool]) -> dict[str, list[int]]:
    """A pre-tokenized TRL record of the same sample: TRL's model shifts the labels, so token t
    trains (``labels[t] = ids[t]``) exactly where Temper's label at input t - 1 is ``ids[t]``."""
    return {
        "input_ids": ids,
        "labels": [i if t else IGNORE_INDEX for i, t in zip(ids, trains, strict=True)],
    }


def make_folder(folder: Path, records: int, seed: int) -> None:
    """The random model, the built-in tokenizer and template, and the chats as JSONL."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**QWEN3_SMALL)).save_pretrained(folder)
    shutil.copy(resources.files("temper.assets") / "tokenizer.json", folder / "tokenizer.json")
    (folder / "template.jinja").write_text(BUILTIN_TEMPLATE)
    with (folder / "chats.jsonl").open("w") as out:
        for chat in conversations(records, seed):
            out.write(json.dumps({"messages": chat}) + "\n")


TIMEOUT_S = 1800.0
"""The longest a side waits for the other (a hung side stops the run)."""


class Turns:
    """The two sides take turns, one step each: a side's turn runs from the moment it gets the
    turn to its next step's end (its data, logging and step), while the other side waits, so
    load from anything else on the machine falls on both alike. A side that fails hands the
    other ``FAILED`` instead, which stops it."""

    FAILED = len(SIDES)

    def __init__(self, ctx: Any) -> None:
        self.barrier = ctx.Barrier(len(SIDES))
        self.turn = ctx.Value("i", 0)
        self.changed = ctx.Condition()

    def wait(self, me: int) -> None:
        with self.changed:
            self.changed.wait_for(lambda: self.turn.value in (me, self.FAILED), TIMEOUT_S)
        if self.turn.value != me:
            raise RuntimeError("the other side failed or timed out")

    def hand_over(self, to: int) -> None:
        with self.changed:
            self.turn.value = to
            self.changed.notify_all()

    def abort(self) -> None:
        """This side failed: release the other, at the warm-up barrier or waiting its turn."""
        self.barrier.abort()
        self.hand_over(self.FAILED)


class StepClock:
    """Each timed step's seconds (within the side's turn) and token counts; the peak resident
    set is reset after the warm-up step, so it covers the timed steps alone."""

    def __init__(self, side: str, turns: Turns, warmup: int, steps: int) -> None:
        self.me, self.other = SIDES.index(side), 1 - SIDES.index(side)
        self.turns, self.warmup, self.steps = turns, warmup, steps
        self.done = 0
        self.start = 0.0
        self.seconds: list[float] = []
        self.counts: list[tuple[int, int, int]] = []
        self.rss_before = _rss_gib()

    def count(self, real: int, trained: int, positions: int) -> None:
        self.counts.append((real, trained, positions))

    def step_end(self) -> None:
        now = time.perf_counter()
        self.done += 1
        if self.done == self.warmup:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on
            self.turns.barrier.wait(TIMEOUT_S)  # both warmed up before any timing
        elif self.done > self.warmup:
            self.seconds.append(now - self.start)
            self.turns.hand_over(self.other)
        if self.done < self.warmup + self.steps:
            self.turns.wait(self.me)
            self.start = time.perf_counter()

    def result(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "counts": self.counts[self.warmup :],
            "peak_gib": _peak_rss_gib() - self.rss_before,
        }


def run_temper(turns: Turns, folder: str, seq_len: int, batch: int, steps: int, lora: bool) -> dict:
    from temper.config import load_config
    from temper.trainer.trainer import Trainer

    warmup = 1
    clock = StepClock("temper", turns, warmup, steps)
    argv = [
        "--model.hf_path", folder,
        "--data.path", f"{folder}/chats.jsonl",
        "--data.chat_template", f"{folder}/template.jinja",
        "--training.seq_len", str(seq_len),
        "--training.local_batch_size", str(batch),
        "--training.steps", str(warmup + steps),
        "--training.dtype", "float32",
        "--optimizer.lr", str(LR),
        "--optimizer.weight_decay", "0",
        "--lr_scheduler.warmup_steps", "0",
        "--job.dump_folder", tempfile.mkdtemp(),
        "--metrics.no_tensorboard",
    ]  # fmt: skip
    if lora:
        argv += ["--lora.enable", "--lora.rank", "8", "--lora.alpha", "16"]
    trainer = Trainer(load_config("temper.recipes.posttrain", "sft_debug", argv))
    train_step = trainer.train_step

    def timed_step(micro_batches: list[dict[str, torch.Tensor]]) -> Any:
        real = sum(int(mb[REAL_TOKENS].sum()) for mb in micro_batches)
        trained = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches)
        clock.count(real, trained, sum(mb["input_ids"].numel() for mb in micro_batches))
        metrics = train_step(micro_batches)
        clock.step_end()
        return metrics

    trainer.train_step = timed_step  # type: ignore[method-assign]
    trainer.train()
    return clock.result()


def run_trl(turns: Turns, folder: str, seq_len: int, batch: int, steps: int, lora: bool) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from temper.data.tokenizer import load_tokenizer

    warmup = 1
    clock = StepClock("trl", turns, warmup, steps)
    tokenizer = load_tokenizer(folder)
    template = Path(folder, "template.jinja").read_text()
    lines = Path(folder, "chats.jsonl").read_text().splitlines()
    examples = [
        trl_example(*tokenize_chat(tokenizer, template, json.loads(x)["messages"])) for x in lines
    ]
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=f"{folder}/tokenizer.json", pad_token="<|pad|>", eos_token="<|endoftext|>"
    )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS)
    args = SFTConfig(
        output_dir=tempfile.mkdtemp(),
        max_steps=warmup + steps,
        per_device_train_batch_size=batch,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_length=seq_len,
        packing=True,
        save_strategy="no",
        report_to=[],
        logging_steps=10**6,
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )

    class Counting(SFTTrainer):
        def training_step(self, model: Any, inputs: dict[str, Any], *rest: Any) -> torch.Tensor:
            positions = int(inputs["input_ids"].numel())  # padding-free: every one real
            clock.count(positions, int((inputs["labels"] != IGNORE_INDEX).sum()), positions)
            return super().training_step(model, inputs, *rest)

    class Clock(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            clock.step_end()

    trainer = Counting(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(examples),
        processing_class=hf_tokenizer,
        peft_config=peft_config,
        callbacks=[Clock()],
    )
    trainer.train()
    return clock.result()


RUNNERS: dict[str, Callable[..., dict]] = {"temper": run_temper, "trl": run_trl}


def run_side(side: str, turns: Turns, *args: Any) -> dict:
    return RUNNERS[side](turns, *args)


def summary(run: dict, batch: int, seq_len: int) -> dict[str, float]:
    """A side's figures over its timed steps: median seconds, tokens over the summed seconds."""
    seconds = sum(run["seconds"])
    real, trained, _ = (sum(c) for c in zip(*run["counts"], strict=True))
    return {
        "seconds_per_step": statistics.median(run["seconds"]),
        "real_tokens_per_second": real / seconds,
        "trained_tokens_per_second": trained / seconds,
        "fill": real / (len(run["seconds"]) * batch * seq_len),
        "peak_gib": run["peak_gib"],
    }


def step_ratios(ours: dict, theirs: dict) -> dict[str, list[float]]:
    """Temper / TRL of each timed step pair (a round: Temper's step, then TRL's)."""
    pairs = list(
        zip(ours["seconds"], theirs["seconds"], ours["counts"], theirs["counts"], strict=True)
    )
    return {
        "seconds_per_step": [a / b for a, b, _, _ in pairs],
        "real_tokens_per_second": [(ca[0] / a) / (cb[0] / b) for a, b, ca, cb in pairs],
        "trained_tokens_per_second": [(ca[1] / a) / (cb[1] / b) for a, b, ca, cb in pairs],
    }


COLUMNS = (
    ("seconds_per_step", "s/step", ".2f"),
    ("real_tokens_per_second", "real tok/s", ",.0f"),
    ("trained_tokens_per_second", "trained tok/s", ",.0f"),
    ("fill", "fill", ".1%"),
    ("peak_gib", "peak GiB", ".2f"),
)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.vs_trl", description=__doc__)
    parser.add_argument("--modes", default="full", help="comma-separated: full, lora")
    parser.add_argument("--seq-len", default="512,1024", help="comma-separated row lengths")
    parser.add_argument("--batch", type=int, default=4, help="rows (TRL: packed sequences)")
    parser.add_argument(
        "--steps", type=int, default=5, help="timed steps (rounds) a side, after one warm-up"
    )
    parser.add_argument("--records", type=int, default=512)
    args = parser.parse_args()
    import transformers
    import trl

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, trl "
        f"{trl.__version__}, {torch.get_num_threads()} threads a side, fp32, batch {args.batch}, "
        f"{args.steps} rounds (a Temper step, then a TRL step) after one warm-up step each\n"
    )
    header = " | ".join(f"{side} {label}" for _, label, _ in COLUMNS for side in ("Temper", "TRL"))
    ratio_names = ("s/step", "real tok/s", "trained tok/s")
    ratio_header = " | ".join(f"{name} ratio (range)" for name in ratio_names)
    print(f"| mode | seq | {header} | {ratio_header} | memory ratio |")
    print("| --- | ---: |" + " ---: |" * (2 * len(COLUMNS) + len(ratio_names) + 1))
    with tempfile.TemporaryDirectory() as folder:
        make_folder(Path(folder), args.records, seed=0)
        for mode in args.modes.split(","):
            for seq_len in map(int, args.seq_len.split(",")):
                runs = run_sides(
                    SIDES, run_side, Turns, folder, seq_len, args.batch, args.steps, mode == "lora"
                )
                ours, theirs = (summary(runs[side], args.batch, seq_len) for side in SIDES)
                cells = " | ".join(
                    f"{side[key]:{fmt}}" for key, _, fmt in COLUMNS for side in (ours, theirs)
                )
                ratios = " | ".join(
                    f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})"
                    for r in step_ratios(runs["temper"], runs["trl"]).values()
                )
                memory = ours["peak_gib"] / theirs["peak_gib"]
                print(f"| {mode} | {seq_len} | {cells} | {ratios} | {memory:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
