"""Temper against TRL on the same model, data, template and loss mask, in one run.

    python -m bench.vs_trl                                   # full SFT, rows of 512 and 1024
    python -m bench.vs_trl --modes full,lora --seq-len 512,1024 --steps 5
    python -m bench.vs_trl --modes grpo --seq-len 64               # GRPO, 64 new tokens

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

GRPO (``--modes grpo``; ``--seq-len`` is then the completion length) trains the same model
from scratch on prompts made of the chats' first user turns (``prompts.jsonl``, rendered by
the same template on both sides), ``--batch`` of them a step with ``--group`` completions
each, sampled at temperature 1 and scored by one reward (``bench_words``: a completion's
words over 10, so groups differ), one update per rollout, no KL term, the token-level
(``dapo``) loss on both sides (each tool's default), full fine-tuning. Neither side ends a
completion before ``--seq-len`` tokens (TRL: ``min_new_tokens``; Temper:
``objective.ignore_eos``), so both decode and train the same number of tokens. A step is the
rollout (decoding, rewards, the forwards it needs) and the update; "real" and "trained"
tokens are the completion tokens, "fill" those over the positions each side computed
(padding included).
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
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from bench.train_step import _peak_rss_gib, _rss_gib, run_sides
from temper.data.batch import IGNORE_INDEX, REAL_TOKENS
from temper.data.chat import BUILTIN_TEMPLATE, tokenize_chat
from temper.objectives.rewards import Record, register_reward

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

SMOLLM2_135M = dict(
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
"""SmolLM2-135M's shape (its published config), random weights: the size issue #39's targets
are stated for, where the body (106M) outweighs the 28M embedding."""

MODELS = {"qwen3-11m": QWEN3_SMALL, "smollm2-135m": SMOLLM2_135M}

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


def make_folder(folder: Path, records: int, seed: int, model: str = "qwen3-11m") -> None:
    """The random model (a ``MODELS`` shape), the built-in tokenizer and template, and the chats
    as JSONL."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(**MODELS[model])
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    shutil.copy(resources.files("temper.assets") / "tokenizer.json", folder / "tokenizer.json")
    (folder / "template.jinja").write_text(BUILTIN_TEMPLATE)
    chats = conversations(records, seed)
    with (folder / "chats.jsonl").open("w") as out:
        for chat in chats:
            out.write(json.dumps({"messages": chat}) + "\n")
    with (folder / "prompts.jsonl").open("w") as out:
        for chat in chats:
            user = next(turn for turn in chat if turn["role"] == "user")
            out.write(json.dumps({"prompt": user["content"], "answer": ""}) + "\n")


@register_reward("bench_words")
def bench_words(prompt: str, completion: str, record: Record) -> float:
    """GRPO's benchmark reward: the completion's words over 10 (a random model's completions
    differ in how many of their ids the built-in tokenizer spells)."""
    return len(completion.split()) / 10


@dataclass(frozen=True)
class Case:
    """One comparison: ``mode`` (full, lora, grpo) at ``seq_len`` (grpo: new tokens), ``batch``
    rows a step (grpo: prompts, ``group`` completions each), ``steps`` timed rounds."""

    folder: str
    mode: str
    seq_len: int
    batch: int
    steps: int
    group: int
    temper_flags: tuple[str, ...] = ()
    """More ``--section.field value`` flags for Temper's side (its other choices)."""


WARMUP = 1
"""Untimed steps a side takes first."""

PROMPT_ROOM = 96
"""GRPO's prompt tokens at most (the chats' first user turns, rendered, are under 60)."""

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


def run_temper(turns: Turns, case: Case) -> dict:
    from temper.config import load_config
    from temper.objectives.rollout import COMPLETION_LENGTHS
    from temper.trainer.trainer import Trainer

    clock = StepClock("temper", turns, WARMUP, case.steps)
    argv = [
        "--model.hf_path", case.folder,
        "--data.chat_template", f"{case.folder}/template.jinja",
        "--training.local_batch_size", str(case.batch),
        "--training.steps", str(WARMUP + case.steps),
        "--training.dtype", "float32",
        "--optimizer.lr", str(LR),
        "--optimizer.weight_decay", "0",
        "--lr_scheduler.warmup_steps", "0",
        "--job.dump_folder", tempfile.mkdtemp(),
        "--metrics.no_tensorboard",
        *case.temper_flags,
    ]  # fmt: skip
    if case.mode == "grpo":
        argv += [
            "--data.path", f"{case.folder}/prompts.jsonl",
            "--training.seq_len", str(PROMPT_ROOM + case.seq_len),
            "--objective.group_size", str(case.group),
            "--objective.max_new_tokens", str(case.seq_len),
            "--objective.rewards", "bench_words",
            "--objective.ignore_eos",
        ]  # fmt: skip
        config = load_config("temper.recipes.posttrain", "grpo_debug", argv)
        config.lora.enable = False
        config.checkpoint.initial_recipe = None  # from the random weights, as TRL's side
    else:
        argv += [
            "--data.path",
            f"{case.folder}/chats.jsonl",
            "--training.seq_len",
            str(case.seq_len),
        ]
        if case.mode == "lora":
            argv += ["--lora.enable", "--lora.rank", "8", "--lora.alpha", "16"]
        config = load_config("temper.recipes.posttrain", "sft_debug", argv)
    trainer = Trainer(config)
    train_step = trainer.train_step

    def timed_step(micro_batches: list[dict[str, torch.Tensor]]) -> Any:
        positions = sum(mb["input_ids"].numel() for mb in micro_batches)
        if case.mode == "grpo":
            real = trained = sum(int(mb[COMPLETION_LENGTHS].sum()) for mb in micro_batches)
        else:
            real = sum(int(mb[REAL_TOKENS].sum()) for mb in micro_batches)
            trained = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches)
        clock.count(real, trained, positions)
        metrics = train_step(micro_batches)
        clock.step_end()
        return metrics

    trainer.train_step = timed_step  # type: ignore[method-assign]
    trainer.train()
    return clock.result() | {"phases_ms": timed_phases(config.job.dump_folder)}


def timed_phases(run_folder: str) -> dict[str, float]:
    """Temper's own phase timers (docs/observability.md) over the timed steps: the mean
    milliseconds a step spent in each, from the run's metrics.jsonl (one row a step)."""
    lines = Path(run_folder, "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines][WARMUP:]
    keys = [key for key in rows[0] if key.startswith("time_") and key.endswith("_ms")]
    return {key[5:-3]: statistics.mean(row[key] for row in rows) for key in keys}


def hf_tokenizer(folder: str) -> Any:
    """The built-in tokenizer and template as transformers' tokenizer, for TRL."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=f"{folder}/tokenizer.json", pad_token="<|pad|>", eos_token="<|endoftext|>"
    )
    tokenizer.chat_template = Path(folder, "template.jinja").read_text()
    return tokenizer


def trl_args(steps: int, **settings: Any) -> dict[str, Any]:
    """The settings both TRL trainers share with Temper's side."""
    return dict(
        output_dir=tempfile.mkdtemp(),
        max_steps=steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        save_strategy="no",
        report_to=[],
        logging_steps=10**6,
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        **settings,
    )


def run_trl(turns: Turns, case: Case) -> dict:
    from transformers import AutoModelForCausalLM, TrainerCallback

    clock = StepClock("trl", turns, WARMUP, case.steps)

    class Clock(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            clock.step_end()

    model = AutoModelForCausalLM.from_pretrained(case.folder, dtype=torch.float32)
    make = trl_grpo if case.mode == "grpo" else trl_sft
    trainer = make(clock, model, case)
    trainer.add_callback(Clock())
    trainer.train()
    return clock.result()


def trl_sft(clock: StepClock, model: Any, case: Case) -> Any:
    """TRL's SFTTrainer on the chats as Temper tokenizes them, packed its default way."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from temper.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(case.folder)
    template = Path(case.folder, "template.jinja").read_text()
    lines = Path(case.folder, "chats.jsonl").read_text().splitlines()
    examples = [
        trl_example(*tokenize_chat(tokenizer, template, json.loads(x)["messages"])) for x in lines
    ]
    peft_config = None
    if case.mode == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS)
    args = SFTConfig(
        **trl_args(
            WARMUP + case.steps,
            per_device_train_batch_size=case.batch,
            max_length=case.seq_len,
            packing=True,
        )
    )

    class Counting(SFTTrainer):
        def training_step(self, model: Any, inputs: dict[str, Any], *rest: Any) -> torch.Tensor:
            positions = int(inputs["input_ids"].numel())  # padding-free: every one real
            clock.count(positions, int((inputs["labels"] != IGNORE_INDEX).sum()), positions)
            return super().training_step(model, inputs, *rest)

    return Counting(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(examples),
        processing_class=hf_tokenizer(case.folder),
        peft_config=peft_config,
    )


def trl_grpo(clock: StepClock, model: Any, case: Case) -> Any:
    """TRL's GRPOTrainer on the same prompts and reward, ``batch`` prompts a step."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    records = [json.loads(x) for x in Path(case.folder, "prompts.jsonl").read_text().splitlines()]
    prompts = [{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in records]

    def words(completions: list[list[dict[str, str]]], **_: Any) -> list[float]:
        return [bench_words("", c[0]["content"], {}) for c in completions]

    args = GRPOConfig(
        **trl_args(
            WARMUP + case.steps,
            per_device_train_batch_size=case.batch * case.group,
            num_generations=case.group,
            max_completion_length=case.seq_len,
            generation_kwargs={"min_new_tokens": case.seq_len},
            temperature=1.0,
            beta=0.0,
            loss_type="dapo",
            num_iterations=1,
        )
    )

    class Counting(GRPOTrainer):
        def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
            inputs = super()._prepare_inputs(generation_batch)
            completions = int(inputs["completion_mask"].sum())
            positions = inputs["prompt_ids"].numel() + inputs["completion_ids"].numel()
            clock.count(completions, completions, positions)
            return inputs

    return Counting(
        model=model,
        reward_funcs=[words],
        args=args,
        train_dataset=Dataset.from_list(prompts),
        processing_class=hf_tokenizer(case.folder),
    )


RUNNERS: dict[str, Callable[..., dict]] = {"temper": run_temper, "trl": run_trl}


def run_side(side: str, turns: Turns, *args: Any) -> dict:
    return RUNNERS[side](turns, *args)


def summary(run: dict, row_positions: int | None) -> dict[str, float]:
    """A side's figures over its timed steps: median seconds, tokens over the summed seconds;
    fill is the real tokens over ``row_positions`` a step (SFT's ``batch * seq_len``), or
    over the positions the side computed (GRPO: None)."""
    seconds = sum(run["seconds"])
    real, trained, positions = (sum(c) for c in zip(*run["counts"], strict=True))
    if row_positions is not None:
        positions = len(run["seconds"]) * row_positions
    return {
        "seconds_per_step": statistics.median(run["seconds"]),
        "real_tokens_per_second": real / seconds,
        "trained_tokens_per_second": trained / seconds,
        "fill": real / positions,
        "peak_gib": run["peak_gib"],
        "phases_ms": run.get("phases_ms", {}),
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
    parser.add_argument("--modes", default="full", help="comma-separated: full, lora, grpo")
    parser.add_argument(
        "--seq-len", default="512,1024", help="comma-separated row lengths (grpo: new tokens)"
    )
    parser.add_argument(
        "--batch", type=int, default=4, help="rows (TRL: packed sequences); grpo: prompts"
    )
    parser.add_argument("--group", type=int, default=8, help="grpo: completions per prompt")
    parser.add_argument(
        "--temper-flags",
        default="",
        help='more flags for Temper\'s side, space-separated: --temper-flags="--objective.x y"',
    )
    parser.add_argument(
        "--steps", type=int, default=5, help="timed steps (rounds) a side, after one warm-up"
    )
    parser.add_argument("--records", type=int, default=512)
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-11m")
    args = parser.parse_args()
    import transformers
    import trl

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, trl "
        f"{trl.__version__}, {torch.get_num_threads()} threads a side, fp32, model {args.model}, "
        f"batch {args.batch}, "
        f"{args.steps} rounds (a Temper step, then a TRL step) after one warm-up step each\n"
    )
    header = " | ".join(f"{side} {label}" for _, label, _ in COLUMNS for side in ("Temper", "TRL"))
    ratio_names = ("s/step", "real tok/s", "trained tok/s")
    ratio_header = " | ".join(f"{name} ratio (range)" for name in ratio_names)
    print(f"| mode | seq | {header} | {ratio_header} | memory ratio |")
    print("| --- | ---: |" + " ---: |" * (2 * len(COLUMNS) + len(ratio_names) + 1))
    notes = []
    with tempfile.TemporaryDirectory() as folder:
        make_folder(Path(folder), args.records, seed=0, model=args.model)
        for mode in args.modes.split(","):
            for seq_len in map(int, args.seq_len.split(",")):
                case = Case(
                    folder, mode, seq_len, args.batch, args.steps, args.group,
                    tuple(args.temper_flags.split()),
                )  # fmt: skip
                runs = run_sides(SIDES, run_side, Turns, case)
                row_positions = None if mode == "grpo" else args.batch * seq_len
                ours, theirs = (summary(runs[side], row_positions) for side in SIDES)
                cells = " | ".join(
                    f"{side[key]:{fmt}}" for key, _, fmt in COLUMNS for side in (ours, theirs)
                )
                ratios = " | ".join(
                    f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})"
                    for r in step_ratios(runs["temper"], runs["trl"]).values()
                )
                memory = ours["peak_gib"] / theirs["peak_gib"]
                print(f"| {mode} | {seq_len} | {cells} | {ratios} | {memory:.2f}x |", flush=True)
                phases = ", ".join(f"{k} {v / 1000:.2f}" for k, v in ours["phases_ms"].items())
                notes.append(f"{mode} {seq_len}: Temper's phases, s a step: {phases}")
    print("\n" + "\n".join(notes))


if __name__ == "__main__":
    main()
