"""Preference rows train the answer's tokens only: against hand-built ids and masks, and against
transformers' apply_chat_template split as TRL splits a pair when a record brings tools."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from temper.data.chat import BUILTIN_TEMPLATE, RecordError, tokenize_chat
from temper.data.preference import (
    PreferenceFormat,
    answer_sample,
    preference_dataset,
    record_pair,
)
from temper.data.sft import sample_labels
from temper.data.tokenizer import Tokenizer, load_tokenizer
from temper.objectives.dpo import DPO, DPOConfig
from tests.unit.test_chat_tools import CALL, TEMPLATE, TOOLS, folder, ours  # noqa: F401 (fixtures)
from tests.unit.test_dpo import _FixedLogits

PROMPT = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "2+2?"},
]
CHOSEN = [{"role": "assistant", "content": "4"}]
REJECTED = [{"role": "assistant", "content": "5"}]
# The built-in template's text of PROMPT with its generation prompt, written out by hand.
PROMPT_TEXT = (
    "<|user|>\nhi<|end|>\n<|assistant|>\nhello<|end|>\n<|user|>\n2+2?<|end|>\n<|assistant|>\n"
)


def _hand_sample(answer: str) -> tuple[list[int], list[bool]]:
    tokenizer = load_tokenizer(None)
    head, tail = tokenizer.encode(PROMPT_TEXT), tokenizer.encode(f"{answer}<|end|>\n")
    return head + tail, [False] * len(head) + [True] * len(tail)


def test_an_assistant_turn_in_the_prompt_does_not_train() -> None:
    tokenizer = load_tokenizer(None)
    sample = answer_sample(tokenizer, BUILTIN_TEMPLATE, PROMPT, CHOSEN)
    assert sample == _hand_sample("4")
    # The SFT path, which the format used before, trains the prompt's "hello" turn too.
    sft_ids, sft_trains = tokenize_chat(tokenizer, BUILTIN_TEMPLATE, PROMPT + CHOSEN)
    assert sft_ids == sample[0] and sum(sft_trains) > sum(sample[1])


def test_rows_and_rewards_count_the_answer_only() -> None:
    """The padded row's labels are the hand-built ones, and DPO's logged rewards are beta times
    the policy-minus-reference log-probability of the answer tokens alone."""
    seq_len = 40
    pairs = [(PROMPT, CHOSEN, REJECTED)]
    stream = preference_dataset(pairs, load_tokenizer(None), BUILTIN_TEMPLATE, seq_len)
    row = next(itertools.islice(iter(stream), 1))
    for name, answer in (("chosen", "4"), ("rejected", "5")):
        inputs, labels = sample_labels(*_hand_sample(answer))
        pad = seq_len - len(inputs)
        assert row[f"{name}_labels"].tolist() == labels + [-100] * pad
        assert row[f"{name}_input_ids"][: len(inputs)].tolist() == inputs
    batch = {key: value.unsqueeze(0) for key, value in row.items()}
    vocab = int(max(batch["chosen_input_ids"].max(), batch["rejected_input_ids"].max())) + 1
    policy, reference = _FixedLogits(vocab), _FixedLogits(vocab)
    with torch.no_grad():
        reference.table.mul_(0.5)

    def answer_log_prob(model: _FixedLogits, answer: str) -> float:
        inputs, labels = sample_labels(*_hand_sample(answer))
        logp = model(torch.tensor(inputs)).log_softmax(-1)
        return sum(logp[t, label].item() for t, label in enumerate(labels) if label != -100)

    beta = 0.1
    _, _, metrics = DPO(DPOConfig(beta=beta), reference=reference).loss(policy, batch)
    for name, answer in (("chosen", "4"), ("rejected", "5")):
        expected = beta * (answer_log_prob(policy, answer) - answer_log_prob(reference, answer))
        assert metrics[f"rewards_{name}"].item() == pytest.approx(expected, rel=1e-5)


def test_an_answer_with_a_non_assistant_turn_is_refused_by_name() -> None:
    """Every token after the prompt trains, so a user turn inside an answer would too."""
    record = {"prompt": PROMPT, "chosen": CHOSEN + PROMPT[:1], "rejected": REJECTED}
    with pytest.raises(RecordError, match=r"pairs.jsonl:3: chosen\[1\].role is 'user'"):
        record_pair(record, "pairs.jsonl:3")


def test_a_records_tools_reach_the_template_as_trl_splits_the_pair(
    folder: Path,  # noqa: F811 (the fixture imported above)
    ours: Tokenizer,  # noqa: F811
) -> None:
    """On Qwen2.5's tool template, a pair whose prompt holds a tool call and its result and
    whose chosen answer is itself a call: ids are transformers' apply_chat_template(...,
    tools=...) of prompt + answer, and the trained tokens are those after the prompt with its
    generation prompt (TRL's DPOTrainer split); without the record's tools they differ."""
    prompt = [
        {"role": "user", "content": "Weather in Paris, then Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "name": "get_weather", "content": "18 °C"},
    ]
    rome = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
    chosen = [{"role": "assistant", "content": None, "tool_calls": [rome]}]
    rejected = [{"role": "assistant", "content": "It is 18 °C in Rome."}]
    record = {"prompt": prompt, "chosen": chosen, "rejected": rejected, "tools": TOOLS}
    pair, outcome = PreferenceFormat(ours, TEMPLATE, 1024).encode(record, "pairs.jsonl:1")
    theirs = AutoTokenizer.from_pretrained(folder)
    head = list(
        theirs.apply_chat_template(prompt, tools=TOOLS, add_generation_prompt=True)["input_ids"]
    )
    assert outcome is None
    for answer, (ids, trains) in zip((chosen, rejected), pair, strict=True):
        full = list(theirs.apply_chat_template(prompt + answer, tools=TOOLS)["input_ids"])
        assert full[: len(head)] == head
        assert ids == full
        assert trains == [False] * len(head) + [True] * (len(full) - len(head))
    untooled = answer_sample(ours, TEMPLATE, record_pair(record, "x")[0], chosen)
    assert untooled[0] != pair[0][0]
