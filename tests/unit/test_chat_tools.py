"""Tool-call chat data on a real tool-calling template (Qwen2.5-Instruct's, a test asset): ids
equal transformers' ``apply_chat_template(..., tools=...)``, the assistant's calls and answer
train and the tool's result does not, prompts carry their tools, bad calls are refused."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from temper.data.chat import (
    BUILTIN_TEMPLATE,
    RecordError,
    check_messages,
    check_tools,
    tokenize_chat,
)
from temper.data.preference import PreferenceFormat
from temper.data.prompts import PromptFormat
from temper.data.sft import SFTFormat
from temper.data.tokenizer import Tokenizer, load_tokenizer

TEMPLATE = (Path(__file__).parent.parent / "assets" / "qwen2_5_chat_template.jinja").read_text()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Temperature of a city in °C",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
RECORD = {
    "tools": TOOLS,
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "name": "get_weather", "content": "18 °C"},
        {"role": "assistant", "content": "It is 18 °C in Paris."},
    ],
}

# A system turn, two calls at once with text before them (one without "type", its arguments a
# JSON string, which reaches the template as given), two results in a row, two rounds.
PARALLEL = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "Paris or Oslo: which is warmer?"},
    {
        "role": "assistant",
        "content": "Checking both.",
        "tool_calls": [
            {**CALL, "id": "a"},
            {"function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "a", "content": "18"},
    {"role": "tool", "content": "9"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And Rome?"},
    {"role": "assistant", "tool_calls": [CALL]},
    {"role": "tool", "content": "21"},
    {"role": "assistant", "content": "Rome, 21."},
]


@pytest.fixture(scope="module")
def folder(
    tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer: Callable[[Path, str], int]
) -> Path:
    """The built-in tokenizer with Qwen's turn markers, and the Qwen2.5 template."""
    path = tmp_path_factory.mktemp("qwen2_5")
    qwen_tokenizer(path, TEMPLATE)
    return path


@pytest.fixture(scope="module")
def ours(folder: Path) -> Tokenizer:
    return load_tokenizer(str(folder))


@pytest.mark.parametrize("conversation", [RECORD["messages"], PARALLEL], ids=["one", "parallel"])
def test_ids_equal_apply_chat_template(
    folder: Path, ours: Tokenizer, conversation: list[dict]
) -> None:
    messages = check_messages(conversation, "data.jsonl:1")
    tools = check_tools(RECORD["tools"], "data.jsonl:1")
    ids, trains = tokenize_chat(ours, TEMPLATE, messages, tools=tools)
    theirs = AutoTokenizer.from_pretrained(folder)
    expected = theirs.apply_chat_template(conversation, tools=TOOLS)["input_ids"]
    assert ids == list(expected)
    trained = ours.decode([t for t, train in zip(ids, trains, strict=True) if train])
    assert trained.count("<tool_call>") == sum(len(m.get("tool_calls", [])) for m in messages)
    assert "tool_response" not in trained and "# Tools" not in trained


def test_mask_trains_calls_and_answer_not_tool_results(folder: Path, ours: Tokenizer) -> None:
    """Against the conversation written out by hand in Qwen2.5's format, piece by piece."""
    preamble = (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:"
        '\n<tools>\n{"type": "function", "function": {"name": "get_weather", "description": '
        '"Temperature of a city in °C", "parameters": {"type": "object", "properties": '
        '{"city": {"type": "string"}}, "required": ["city"]}}}\n</tools>\n\nFor each function '
        "call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    )
    pieces = [
        (preamble + "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n", 0),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>\n",
            1,
        ),
        ("<|im_start|>user\n<tool_response>\n18 °C\n</tool_response><|im_end|>\n", 0),
        ("<|im_start|>assistant\n", 0),
        ("It is 18 °C in Paris.<|im_end|>\n", 1),
    ]
    theirs = AutoTokenizer.from_pretrained(folder)
    text = theirs.apply_chat_template(RECORD["messages"], tools=TOOLS, tokenize=False)
    assert "".join(piece for piece, _ in pieces) == text
    expected_ids = [i for piece, _ in pieces for i in ours.encode(piece)]
    expected_mask = [bool(t) for piece, t in pieces for _ in ours.encode(piece)]
    sample = SFTFormat(ours, TEMPLATE, seq_len=1024).encode(RECORD, "data.jsonl:1")
    assert sample == ((expected_ids, expected_mask), None)


def test_prompt_renders_tools_and_generation_prompt(folder: Path, ours: Tokenizer) -> None:
    prompt = RECORD["messages"][:3]
    record = {"prompt": prompt, "tools": TOOLS, "answer": "18"}
    (ids, kept), outcome = PromptFormat(ours, TEMPLATE, width=1024).encode(record, "p.jsonl:1")
    theirs = AutoTokenizer.from_pretrained(folder)
    expected = theirs.apply_chat_template(prompt, tools=TOOLS, add_generation_prompt=True)
    assert (ids, kept, outcome) == (list(expected["input_ids"]), record, None)
    assert ours.decode(ids).endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")


def _with_call(call: object) -> dict:
    record = json.loads(json.dumps(RECORD))
    record["messages"][1]["tool_calls"] = call
    return record


CALL0 = r"messages\[1\]\.tool_calls\[0\]"
ARGS = rf"{CALL0}\.function\.arguments"


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (_with_call([{"type": "function", "function": {"name": "f", "arguments": "{city"}}]),
         rf"{ARGS} is a string that is not JSON"),
        (_with_call([{"type": "function", "function": {"name": "f", "arguments": [1]}}]),
         rf"{ARGS} must be an object"),
        (_with_call([{"type": "function", "function": {"arguments": {}}}]),
         rf"{CALL0}\.function\.name must be a non-empty string"),
        (_with_call([{"name": "f", "arguments": {}}]), CALL0 + r" must be \{\"type\""),
        (_with_call([{"type": "code", "function": {"name": "f", "arguments": {}}}]),
         rf"{CALL0}\.type is 'code'"),
        (_with_call({"name": "f"}), r"messages\[1\]\.tool_calls must be a non-empty list"),
        ({**RECORD, "tools": [{"name": "f"}]}, r"tools\[0\] must be \{\"type\": \"function\""),
        ({**RECORD, "tools": {"name": "f"}}, r"'tools' must be a list"),
        ({"messages": [{"role": "tool", "content": "1", "tool_call_id": 3}]},
         r"messages\[0\]\.tool_call_id must be a string"),
        ({"messages": [{"role": "assistant", "content": None}]},
         r"messages\[0\]\.content must be a string"),
    ],
)  # fmt: skip
def test_malformed_tool_data_refused(ours: Tokenizer, record: dict, message: str) -> None:
    with pytest.raises(RecordError, match=rf"^data\.jsonl:7: {message}"):
        SFTFormat(ours, TEMPLATE, seq_len=1024).encode(record, "data.jsonl:7")


def test_template_without_tool_support_refused(ours: Tokenizer) -> None:
    """The built-in template writes only roles and contents: the call would vanish."""
    messages = check_messages(RECORD["messages"], "x")
    messages[1]["content"] = "Checking."
    with pytest.raises(ValueError, match="does not write the tools or tool calls.*'get_weather'"):
        tokenize_chat(ours, BUILTIN_TEMPLATE, messages)
    tokenize_chat(ours, TEMPLATE, messages)  # the same with a template that writes calls


def test_prompt_and_preference_data_refuse_a_template_without_tool_support(
    ours: Tokenizer,
) -> None:
    """GRPO prompts and preference pairs render through the same check: the built-in template
    drops the tools (and the answer's call), so the prompt would not show them."""
    prompt = {"tools": TOOLS, "prompt": [{"role": "user", "content": "Weather in Paris?"}]}
    call = {"role": "assistant", "content": "Checking.", "tool_calls": [CALL]}
    pair = {**prompt, "chosen": [call], "rejected": [{"role": "assistant", "content": "No."}]}
    missing = "does not write the tools or tool calls.*'get_weather'"
    for fmt, record in (
        (PromptFormat(ours, BUILTIN_TEMPLATE, width=1024), prompt),
        (PreferenceFormat(ours, BUILTIN_TEMPLATE, 1024), pair),
    ):
        with pytest.raises(ValueError, match=missing):
            fmt.encode(record, "x.jsonl:1")
    PromptFormat(ours, TEMPLATE, width=1024).encode(prompt, "x.jsonl:1")
    PreferenceFormat(ours, TEMPLATE, 1024).encode(pair, "x.jsonl:1")
