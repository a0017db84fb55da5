"""Chat templates render as transformers renders them: the tokenizer's special tokens
(`bos_token`, `eos_token`, ...), `tools` as None, `strftime_now`. Ids of whole conversations
and of generation prompts against `apply_chat_template` on templates in the style of three
real families."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest
import tokenizers
from transformers import AutoTokenizer

from temper.data.chat import load_chat_template, render_chat, tokenize_chat
from temper.data.tokenizer import load_tokenizer

LLAMA3 = (
    "{{- bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
QWEN = (
    "{%- if tools %}{{ '<|im_start|>system\\nTools: ' + tools | tojson + '<|im_end|>\\n' }}"
    "{%- endif %}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DEEPSEEK = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\\n\\n' }}"
    "{% else %}{{ 'Assistant: ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
FAMILIES = {
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
    "qwen": (QWEN, None, "<|im_end|>"),
    "deepseek": (DEEPSEEK, "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
}
SPECIAL = [
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<|im_start|>", "<|im_end|>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
]  # fmt: skip
CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "sort: 3 1 2"},
    {"role": "assistant", "content": "1 2 3"},
    {"role": "user", "content": "copy: a b"},
    {"role": "assistant", "content": "a b"},
]


def family_folder(folder: Path, family: str) -> Path:
    template, bos, eos = FAMILIES[family]
    folder.mkdir()
    raw = tokenizers.Tokenizer.from_str(
        resources.files("temper.assets").joinpath("tokenizer.json").read_text()
    )
    raw.add_special_tokens(SPECIAL)
    raw.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "pad_token": "<|pad|>",
    }
    if bos is not None:
        config["bos_token"] = bos
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ids_equal_apply_chat_template(tmp_path: Path, family: str) -> None:
    folder = family_folder(tmp_path / family, family)
    ours, template = load_tokenizer(str(folder)), load_chat_template(None, str(folder))
    theirs = AutoTokenizer.from_pretrained(folder)
    ids, trains = tokenize_chat(ours, template, CONVERSATION)
    assert ids == list(theirs.apply_chat_template(CONVERSATION)["input_ids"])
    bos = FAMILIES[family][1]
    if bos is not None:
        assert ids[0] == ours.encode(bos)[0]  # the BOS the template writes is there
    # The trained tokens are the assistants' answers and what closes them.
    trained = ours.decode([t for t, train in zip(ids, trains, strict=True) if train])
    assert "1 2 3" in trained and "a b" in trained and "sort" not in trained
    prompt = CONVERSATION[:2]
    text = render_chat(template, prompt, True, **ours.special_tokens)
    expected = theirs.apply_chat_template(prompt, add_generation_prompt=True)["input_ids"]
    assert ours.encode(text) == list(expected)


# The same families with the assistant's text marked as transformers' templates mark it.
TAGGED = {
    "llama3": LLAMA3.replace(
        "{{ message['content'] | trim }}{{ '<|eot_id|>' }}",
        "{% if message['role'] == 'assistant' %}{% generation %}"
        "{{ message['content'] | trim }}{{ '<|eot_id|>' }}{% endgeneration %}"
        "{% else %}{{ message['content'] | trim }}{{ '<|eot_id|>' }}{% endif %}",
    ),
    "qwen": QWEN.replace(
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}",
        "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}"
        "{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
        "{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}",
    ),
    "deepseek": DEEPSEEK.replace(
        "{{ 'Assistant: ' + message['content'] + eos_token }}",
        "{{ 'Assistant: ' }}{% generation %}{{ message['content'] + eos_token }}"
        "{% endgeneration %}",
    ),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_assistant_masks_equal_transformers(tmp_path: Path, family: str) -> None:
    """On a template with ``{% generation %}`` blocks, the ids and the trained tokens equal
    ``apply_chat_template(..., return_assistant_tokens_mask=True)``; and they equal what the
    turn-by-turn method finds on the same template without the tags."""
    folder = family_folder(tmp_path / family, family)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TAGGED[family]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(folder)
    assert "{% generation %}" in load_chat_template(None, str(folder))
    ids, trains = tokenize_chat(ours, TAGGED[family], CONVERSATION)
    expected = theirs.apply_chat_template(
        CONVERSATION, return_assistant_tokens_mask=True, return_dict=True
    )
    assert ids == list(expected["input_ids"])
    assert trains == [bool(m) for m in expected["assistant_masks"]]
    assert any(trains) and not all(trains)
    assert (ids, trains) == tokenize_chat(ours, FAMILIES[family][0], CONVERSATION)
    assert tokenize_chat(ours, TAGGED[family], CONVERSATION, train_on_prompt=True)[1] == [
        True
    ] * len(ids)
