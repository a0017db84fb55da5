"""Chat templates render as transformers renders them; the assistant mask is where it belongs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from temper.data.chat import (
    BUILTIN_TEMPLATE,
    RecordError,
    load_chat_template,
    render_chat,
    tokenize_chat,
)
from temper.data.sft import read_sft_records
from temper.data.tokenizer import load_tokenizer

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "copy: a b"},
    {"role": "assistant", "content": "a b"},
    {"role": "user", "content": "sort: 3 1"},
    {"role": "assistant", "content": "1 3"},
]
# A tiny template in the style of real ones: a system default, trimmed blocks, a guard.
TINY_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|system|>\ndefault<|end|>\n{% endif %}\n"
    "{% for m in messages %}\n"
    "  {% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role') }}{% endif %}\n"
    "<|{{ m['role'] }}|>\n{{ m['content'] | trim }}<|end|>\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def hf_tokenizer() -> PreTrainedTokenizerFast:
    from importlib import resources

    path = resources.files("temper.assets").joinpath("tokenizer.json")
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>")


@pytest.mark.parametrize("template", [BUILTIN_TEMPLATE, TINY_TEMPLATE], ids=["builtin", "tiny"])
@pytest.mark.parametrize("generation_prompt", [False, True])
@pytest.mark.parametrize("turns", [2, 3, 5])
def test_render_equals_transformers(
    hf_tokenizer: PreTrainedTokenizerFast, template: str, generation_prompt: bool, turns: int
) -> None:
    messages = CONVERSATION[5 - turns :]
    expected = hf_tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt
    )
    assert render_chat(template, messages, generation_prompt) == expected


def test_assistant_mask_by_hand() -> None:
    tokenizer = load_tokenizer(None)
    ids, trains = tokenize_chat(tokenizer, BUILTIN_TEMPLATE, CONVERSATION[1:3])
    tokens = [tokenizer.decode([i]) for i in ids]
    assert tokens == [
        "<|user|>", "\n", "copy", ":", " a", " b", "<|end|>", "\n",
        "<|assistant|>", "\n", "a", " b", "<|end|>", "\n",
    ]  # fmt: skip
    # The answer and its closing <|end|>\n train; the prompt and the assistant header do not.
    assert trains == [False] * 10 + [True] * 4
    _, all_train = tokenize_chat(tokenizer, BUILTIN_TEMPLATE, CONVERSATION[1:3], True)
    assert all(all_train)


def test_folder_template(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TINY_TEMPLATE}))
    assert load_chat_template(None, str(tmp_path)) == TINY_TEMPLATE
    assert load_chat_template(None, None) == BUILTIN_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no chat template"):
        load_chat_template(None, str(tmp_path))


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", "invalid JSON"),
        ('{"text": "x"}', "'messages' must be a non-empty list"),
        ('{"messages": [{"role": "bot", "content": "x"}]}', r"messages\[0\].role is 'bot'"),
        ('{"messages": [{"role": "user", "content": 3}]}', r"messages\[0\].content must be"),
    ],
)
def test_malformed_record_names_file_and_line(tmp_path: Path, line: str, problem: str) -> None:
    good = json.dumps({"messages": CONVERSATION[1:3]})
    path = tmp_path / "chat.jsonl"
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(RecordError, match=f"{path}:3: {problem}"):
        read_sft_records(str(path))
