"""Chat records -> token ids with a mask of the tokens that train (assistant turns by default).

A conversation is rendered with a Jinja chat template the way ``transformers`` renders it
(sandboxed, ``trim_blocks`` and ``lstrip_blocks``, with the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...), ``strftime_now``, and ``tools`` / ``documents`` as None),
either the model folder's or the
built-in one for the built-in tokenizer. To know which tokens an assistant wrote, the
conversation is rendered turn by turn: the text up to an assistant turn with the generation
prompt, then through that turn; the difference is the assistant's. Each piece is tokenized on
its own, so a token never straddles a prompt/answer boundary. A template that marks the
assistant's text itself with ``{% generation %}...{% endgeneration %}`` (what transformers'
``return_assistant_tokens_mask`` reads) is taken at its word instead: the whole conversation is
tokenized once and the tokens inside the marked spans train.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from temper.data.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant")

BUILTIN_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
"""The template of the built-in tokenizer: a role token, the content, ``<|end|>`` per turn."""

Message = dict[str, str]


class RecordError(ValueError):
    """A data record is malformed; the message names the file, the line and the problem."""


SPAN_START, SPAN_END = "\ue000", "\ue001"
"""Private-use characters that bracket a ``{% generation %}`` block in the rendered text until
the spans are read off; no tokenizer ever sees them."""


class GenerationSpans(Extension):
    """``{% generation %}...{% endgeneration %}``: the block renders as itself, bracketed by
    ``SPAN_START`` / ``SPAN_END`` so that ``render_spans`` can find the assistant's text."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_bracket"), [], [], body).set_lineno(lineno)

    def _bracket(self, caller: Any) -> str:
        return SPAN_START + caller() + SPAN_END


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@cache
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", GenerationSpans],
    )
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env.from_string(template)


def render_chat(
    template: str, messages: Sequence[Message], add_generation_prompt: bool = False, **extra: Any
) -> str:
    """The conversation as text, like ``apply_chat_template(..., tokenize=False)``; ``extra``
    are more template variables (a tokenizer's ``special_tokens``)."""
    return render_spans(template, messages, add_generation_prompt, **extra)[0]


def render_spans(
    template: str, messages: Sequence[Message], add_generation_prompt: bool = False, **extra: Any
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans [start, end) of its ``{% generation %}``
    blocks (none when the template has no such block)."""
    for message in messages:
        if SPAN_START in message["content"] or SPAN_END in message["content"]:
            raise ValueError("a message holds a private-use character U+E000/U+E001")
    variables = {"tools": None, "documents": None, **extra}
    marked = _compile(template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
    )
    text, spans, start = "", [], 0
    for char in marked:
        if char == SPAN_START:
            start = len(text)
        elif char == SPAN_END:
            spans.append((start, len(text)))
        else:
            text += char
    return text, spans


def load_chat_template(path: str | None, tokenizer_folder: str | None) -> str:
    """A template file (``path``), else the tokenizer folder's, else the built-in one.

    A folder's template is ``chat_template.jinja`` or ``tokenizer_config.json``'s
    ``chat_template`` field, where ``transformers`` keeps it.
    """
    if path is not None:
        return Path(path).read_text()
    folder = Path(tokenizer_folder) if tokenizer_folder is not None else None
    if folder is not None and folder.is_dir():
        if (folder / "chat_template.jinja").is_file():
            return (folder / "chat_template.jinja").read_text()
        config_path = folder / "tokenizer_config.json"
        if config_path.is_file():
            template = json.loads(config_path.read_text()).get("chat_template")
            if isinstance(template, str):
                return template
        raise ValueError(
            f"{folder}: no chat template (chat_template.jinja or tokenizer_config.json's "
            "chat_template); give one with --data.chat_template FILE"
        )
    return BUILTIN_TEMPLATE


def tokenize_chat(
    tokenizer: Tokenizer,
    template: str,
    messages: Sequence[Message],
    train_on_prompt: bool = False,
) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and, per token, whether it trains.

    Raises ValueError when the template does not render a conversation as the
    concatenation of its turns (the assistant spans could not be found).
    """
    full, spans = render_spans(template, messages, **tokenizer.special_tokens)
    if spans:
        ids, offsets = tokenizer.encode_with_offsets(full)
        trains = [
            train_on_prompt or any(s < stop and start < e for s, e in spans)
            for start, stop in offsets
        ]
        return ids, trains
    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render_chat(template, messages[:i], True, **tokenizer.special_tokens)
        through = render_chat(template, messages[: i + 1], **tokenizer.special_tokens)
        if not (prompt.startswith(done) and through.startswith(prompt)):
            raise ValueError(
                "the chat template does not render a conversation as a prefix of the longer "
                "one, so the assistant tokens cannot be located"
            )
        pieces += [(prompt[len(done) :], train_on_prompt), (through[len(prompt) :], True)]
        done = through
    if not full.startswith(done):
        raise ValueError("the chat template renders the whole conversation differently")
    pieces.append((full[len(done) :], train_on_prompt))
    ids: list[int] = []
    trains: list[bool] = []
    for text, trainable in pieces:
        piece = tokenizer.encode(text) if text else []
        ids += piece
        trains += [trainable] * len(piece)
    return ids, trains


def stop_token_ids(tokenizer: Tokenizer, template: str) -> set[int]:
    """The ids that end an assistant turn: EOS, and the first token the template writes after
    an answer (``<|end|>``, ``<|im_end|>``, ``<|eot_id|>``...), so decoding stops there."""
    question = [{"role": "user", "content": "1"}]
    prompt = render_chat(template, question, True, **tokenizer.special_tokens)
    answer = {"role": "assistant", "content": "1"}
    answered = render_chat(template, [*question, answer], **tokenizer.special_tokens)
    stops = {tokenizer.eos_id}
    if answered.startswith(prompt + "1"):
        after = tokenizer.encode(answered[len(prompt) + 1 :])
        if after:
            stops.add(after[0])
    return stops


def check_messages(value: Any, where: str, field: str = "messages") -> list[Message]:
    """``value`` as a list of ``{"role", "content"}`` messages, or RecordError at ``where``."""
    if not isinstance(value, list) or not value:
        raise RecordError(f"{where}: {field!r} must be a non-empty list of messages")
    for j, message in enumerate(value):
        if not isinstance(message, dict):
            raise RecordError(f"{where}: {field}[{j}] is not an object")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise RecordError(f"{where}: {field}[{j}].role is {role!r}; expected one of {ROLES}")
        if not isinstance(content, str):
            raise RecordError(f"{where}: {field}[{j}].content must be a string")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def read_jsonl(path: str, limit: int | None = None) -> list[tuple[str, dict[str, Any]]]:
    """The records of a JSONL file (the first ``limit`` when given), each with its
    ``file:line`` for error messages."""
    records: list[tuple[str, dict[str, Any]]] = []
    with Path(path).open(encoding="utf-8") as file:
        for lineno, line in enumerate(file, start=1):
            if limit is not None and len(records) == limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except ValueError as error:
                raise RecordError(f"{where}: invalid JSON ({error})") from None
            if not isinstance(record, dict):
                raise RecordError(f"{where}: expected a JSON object, got {type(record).__name__}")
            records.append((where, record))
    if not records:
        raise RecordError(f"{path}: no records")
    return records
