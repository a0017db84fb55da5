"""bench.vs_trl's shared part: TRL is given the very tokens and loss mask Temper trains on,
and the very prompt tokens Temper's GRPO samples from."""

from __future__ import annotations

import itertools
import shutil
from importlib import resources
from pathlib import Path

import torch
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from bench.vs_trl import conversations, hf_tokenizer, trl_example
from temper.data.batch import IGNORE_INDEX, REAL_TOKENS
from temper.data.chat import BUILTIN_TEMPLATE, render_chat, tokenize_chat
from temper.data.sft import sft_dataset
from temper.data.tokenizer import load_tokenizer


def test_trl_trains_on_the_assistant_tokens_temper_trains_on() -> None:
    """Per chat, by hand: the tokens either side trains decode to the assistant turns, each
    with its ``<|end|>`` line; TRL's collator (padding-free, as packing makes it) leaves them
    as the labels its model shifts, so its label at t + 1 is Temper's label at t."""
    tokenizer = load_tokenizer(None)
    chats = conversations(6, seed=1)
    examples = [trl_example(*tokenize_chat(tokenizer, BUILTIN_TEMPLATE, chat)) for chat in chats]
    pad = tokenizer.pad_id
    flat = DataCollatorForLanguageModeling(pad_token_id=pad, padding_free=True)(examples)
    starts = (flat["position_ids"][0] == 0).nonzero().flatten().tolist() + [flat["labels"].size(1)]
    temper = sft_dataset(chats, tokenizer, BUILTIN_TEMPLATE, 1024, pack=False, seed=0)
    by_inputs = {}
    for row in itertools.islice(temper, len(chats)):
        n = int(row[REAL_TOKENS])
        by_inputs[tuple(row["input_ids"][:n].tolist())] = row["labels"][:n]
    spans = itertools.pairwise(starts)
    for chat, example, (start, stop) in zip(chats, examples, spans, strict=True):
        ids, trl_labels = example["input_ids"], flat["labels"][0, start:stop]
        assert flat["input_ids"][0, start:stop].tolist() == ids
        expected = "".join(m["content"] + "<|end|>\n" for m in chat if m["role"] == "assistant")
        trained = trl_labels[trl_labels != IGNORE_INDEX].tolist()
        assert tokenizer.decode(trained) == expected
        temper_labels = by_inputs[tuple(ids[:-1])]
        assert torch.equal(temper_labels, trl_labels[1:])


def test_trl_samples_from_the_prompt_tokens_temper_samples_from(tmp_path: Path) -> None:
    """GRPO's prompts (each chat's first user turn): TRL renders them with transformers'
    tokenizer and the same template; the ids equal what Temper's prompt data encodes."""
    shutil.copy(resources.files("temper.assets") / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "template.jinja").write_text(BUILTIN_TEMPLATE)
    theirs, ours = hf_tokenizer(str(tmp_path)), load_tokenizer(None)
    for chat in conversations(6, seed=2):
        prompt = [next(turn for turn in chat if turn["role"] == "user")]
        rendered = render_chat(BUILTIN_TEMPLATE, prompt, True, **ours.special_tokens)
        trl_ids = theirs.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        assert trl_ids == ours.encode(rendered)
        assert rendered.startswith(f"<|user|>\n{prompt[0]['content']}")
