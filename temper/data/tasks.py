"""Built-in chat tasks from the synthetic generator: copy and sort, as SFT and preference data.

A synthetic ``"copy: a b c -> a b c"`` line becomes a user turn (``"copy: a b c"``) and the
assistant's answer (``"a b c"``). A rejected answer for DPO is the correct one with one
item changed, so the pair differs only where the task is done wrong. Examples are indexed;
``split`` "train" and "eval" use disjoint index ranges, so evaluation is held out.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Literal

from temper.config import Config, Data
from temper.data.chat import load_chat_template
from temper.data.loader import BatchLoader, build_text_loader
from temper.data.multimodal import (
    build_image_dataset,
    collate,
    has_image_parts,
    read_image_records,
)
from temper.data.preference import preference_dataset, read_preference_records
from temper.data.prompts import PromptRecord, prompt_dataset, read_prompt_records
from temper.data.sft import read_sft_records, sft_dataset
from temper.data.sources import check_documents
from temper.data.synthetic import _copy, _sort
from temper.data.tokenizer import Tokenizer

Split = Literal["train", "eval"]
_EVAL_OFFSET = 10_000_000


def task_example(seed: int, index: int) -> tuple[str, str]:
    """(question, answer) number ``index`` of the stream for ``seed``."""
    rng = random.Random(f"temper.tasks:{seed}:{index}")
    question, answer = rng.choice((_copy, _sort))(rng).split(" -> ")
    return question, answer


def _index(split: Split, i: int) -> int:
    return i + (_EVAL_OFFSET if split == "eval" else 0)


def sft_conversations(seed: int, split: Split, count: int) -> list[list[dict[str, str]]]:
    """``count`` one-turn conversations of ``split``."""
    conversations = []
    for i in range(count):
        question, answer = task_example(seed, _index(split, i))
        conversations.append(
            [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        )
    return conversations


def wrong_answer(answer: str, rng: random.Random) -> str:
    """``answer`` with one of its items replaced by a different one of the same kind."""
    items = answer.split(" ")
    k = rng.randrange(len(items))
    pool = "0123456789" if items[k].isdigit() else "abcdefghijklmnopqrstuvwxyz"
    items[k] = rng.choice([c for c in pool if c != items[k]])
    return " ".join(items)


def preference_pairs(
    seed: int, split: Split, count: int
) -> list[tuple[list[dict[str, str]], list[dict[str, str]], list[dict[str, str]]]]:
    """``count`` (prompt, chosen, rejected) message triples of ``split``."""
    pairs = []
    for i in range(count):
        question, answer = task_example(seed, _index(split, i))
        rng = random.Random(f"temper.tasks.rejected:{seed}:{_index(split, i)}")
        pairs.append(
            (
                [{"role": "user", "content": question}],
                [{"role": "assistant", "content": answer}],
                [{"role": "assistant", "content": wrong_answer(answer, rng)}],
            )
        )
    return pairs


def task_prompts(seed: int, split: Split, count: int) -> list[PromptRecord]:
    """``count`` (user message, record with the reference answer) prompts of ``split``, for
    RL."""
    prompts = []
    for i in range(count):
        question, answer = task_example(seed, _index(split, i))
        record = {"prompt": question, "answer": answer}
        prompts.append(([{"role": "user", "content": question}], record))
    return prompts


def build_chat_loader(
    data: Data,
    tokenizer: Tokenizer,
    seq_len: int,
    batch_size: int,
    *,
    seed: int,
    dp_rank: int,
    dp_world: int,
    tokenizer_folder: str | None,
) -> BatchLoader:
    """The loader of an sft, preference or prompt run: the user's JSONL file, or the built-in
    tasks' training split; the template comes from ``data.chat_template`` or the tokenizer
    folder. Prompt rows are ``seq_len`` tokens wide: the room left for the prompt."""
    if is_image_data(data):
        dataset = build_image_dataset(
            data,
            tokenizer,
            seq_len,
            seed=seed,
            dp_rank=dp_rank,
            dp_world=dp_world,
            folder=tokenizer_folder,
        )
        return BatchLoader(dataset, batch_size, collate)
    template = load_chat_template(data.chat_template, tokenizer_folder)
    common = dict(policy=data.max_length_policy, seed=seed, dp_rank=dp_rank, dp_world=dp_world)
    if data.format == "sft":
        conversations = (
            read_sft_records(data.path)
            if data.path is not None
            else sft_conversations(seed, "train", data.builtin_examples)
        )
        dataset = sft_dataset(
            conversations,
            tokenizer,
            template,
            seq_len,
            train_on_prompt=data.train_on_prompt,
            pack=data.pack,
            **common,
        )
    elif data.format == "prompt":
        records = (
            read_prompt_records(data.path)
            if data.path is not None
            else task_prompts(seed, "train", data.builtin_examples)
        )
        dataset = prompt_dataset(
            records, tokenizer, template, seq_len, seed=seed, dp_rank=dp_rank, dp_world=dp_world
        )
    else:
        pairs = (
            read_preference_records(data.path)
            if data.path is not None
            else preference_pairs(seed, "train", data.builtin_examples)
        )
        dataset = preference_dataset(pairs, tokenizer, template, seq_len, **common)
    return BatchLoader(dataset, batch_size)


def check_data(data: Data, limit: int) -> None:
    """Raise ValueError naming the file and line unless ``data.path`` exists and its first
    ``limit`` records parse as ``data.format``: what a run would fail on, checked cheaply
    before it starts."""
    if data.path is None:
        return
    if data.format == "text":
        check_documents(data.path, data.text_field, limit)
        return
    if not Path(data.path).is_file():
        raise FileNotFoundError(
            f"{data.path}: no such file (data.format {data.format} reads one JSONL file)"
        )
    if is_image_data(data):
        read_image_records(data.path, limit)
        return
    readers = {
        "sft": read_sft_records,
        "preference": read_preference_records,
        "prompt": read_prompt_records,
    }
    readers[data.format](data.path, limit)


def is_image_data(data: Data) -> bool:
    """SFT data with images: the built-in image task, or a file whose records hold image
    parts (list contents)."""
    if data.format != "sft":
        return False
    return data.builtin_images if data.path is None else has_image_parts(data.path)


def build_loader(config: Config, tokenizer: Tokenizer, dp_rank: int, dp_world: int) -> BatchLoader:
    """This data rank's batches for ``data.format``: packed text, or chat (sft, preference,
    prompt) data. Prompt rows leave room for the completion the objective samples."""
    training = config.training
    if config.data.format == "text":
        return build_text_loader(
            tokenizer,
            training.seq_len,
            training.local_batch_size,
            path=config.data.path,
            text_field=config.data.text_field,
            seed=training.seed,
            dp_rank=dp_rank,
            dp_world=dp_world,
        )
    return build_chat_loader(
        config.data,
        tokenizer,
        training.seq_len - config.objective.completion_tokens(),
        training.local_batch_size,
        seed=training.seed,
        dp_rank=dp_rank,
        dp_world=dp_world,
        tokenizer_folder=config.data.tokenizer_path or config.model.hf_path,
    )
