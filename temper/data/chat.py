"""Chat records -> token ids with a mask of the tokens that train (assistant turns by default).

A conversation is rendered with a Jinja chat template the way ``transformers`` renders it
(sandboxed, ``trim_blocks`` and ``lstrip_blocks``, with the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...), ``strftime_now``, ``tools`` (a record's function
descriptions, else None) and ``documents`` as None), either the model folder's or the built-in
one for the built-in tokenizer. Messages may be ``tool`` results and assistant turns may carry
``tool_calls``; the template decides how they read, and the assistant's calls train with its
turn while tool results are prompt. To know which tokens an assistant wrote, the
conversation is rendered turn by turn: the text up to an assistant turn with the generation
prompt, then through that turn; the difference is the assistant's. Each piece is tokenized on
its own, so a token never straddles a prompt/answer boundary. A template that marks the
assistant's text itself with ``{% generation %}...{% endgeneration %}`` (what transformers'
``return_assistant_tokens_mask`` reads) is taken at its word instead: the whole conversation is
tokenized once and the tokens inside the marked spans train.
"""

from __future__ import annotations

import json
import math
import re
import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from temper.config import Data
from temper.data.sources.base import RecordError
from temper.data.sources.jsonl import record_too_long
from temper.data.tokenizer import Tokenizer
from temper.utils.paths import inside

ROLES = ("system", "user", "assistant")
CHAT_ROLES = (*ROLES, "tool")
"""The roles of text chat records: ``tool`` holds a tool's result (image records keep ROLES)."""

BUILTIN_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
"""The template of the built-in tokenizer: a role token, the content, ``<|end|>`` per turn."""

Message = dict[str, Any]
"""``role``, ``content`` and, by role, ``tool_calls`` (assistant), ``name`` / ``tool_call_id``
(tool)."""

Tool = dict[str, Any]
"""A function description as transformers takes it: ``{"type": "function", "function": {"name",
"description", "parameters"}}``."""


class TemplateError(ValueError):
    """A chat template that fails to render: a syntax error, an operation the sandbox refuses,
    a render past ``data.template_timeout_s`` or larger than ``data.max_template_chars``."""


@dataclass(frozen=True)
class TemplateLimits:
    """Bounds of one render of a chat template, which comes with a model folder and is code:
    its time (stopped by SIGALRM in the main thread; elsewhere unbounded, since only the
    main thread receives signals) and the characters it writes, or any one repetition or
    concatenation inside it makes (checked before the string exists)."""

    timeout_s: float = Data.template_timeout_s
    max_chars: int = Data.max_template_chars

    @classmethod
    def of(cls, data: Data) -> TemplateLimits:
        return cls(data.template_timeout_s, data.max_template_chars)


DEFAULT_LIMITS = TemplateLimits()


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


class _BoundedConcat(CodeGenerator):
    """Compiles ``a ~ b`` to the environment's size-checked join (jinja's own joins unchecked)."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with every operator that can build a large value in one step (``*``,
    ``**``, ``+``, ``~``) refused before it builds one over ``max_chars``: ``'a' * 2000000000``
    fails at once instead of allocating gigabytes."""

    intercepted_binops = frozenset({"*", "**", "+"})
    code_generator_class = _BoundedConcat

    def __init__(self, max_chars: int, **options: Any) -> None:
        super().__init__(**options)
        self.max_chars = max_chars

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        size = _result_size(operator, left, right)
        if size > self.max_chars:
            raise SecurityError(
                f"{left!r:.20} {operator} {right!r:.20} would make about {size} characters or "
                f"items, over data.max_template_chars ({self.max_chars})"
            )
        return super().call_binop(context, operator, left, right)

    def bounded_join(self, pieces: Sequence[Any]) -> str:
        texts = [str(piece) for piece in pieces]
        if sum(map(len, texts)) > self.max_chars:
            raise SecurityError(f"a '~' would make over data.max_template_chars ({self.max_chars})")
        return "".join(texts)


def _result_size(operator: str, left: Any, right: Any) -> float:
    """About how large ``left <operator> right`` would be: a sequence's length, a number's
    digits; 0 for what stays small."""
    sized = (str, list, tuple)
    if operator == "*" and isinstance(right, sized) and isinstance(left, int):
        left, right = right, left
    if operator == "*" and isinstance(left, sized) and isinstance(right, int):
        return len(left) * right
    if operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        return len(left) + len(right)
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
        return right * math.log10(abs(left))
    return 0


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """``tojson`` with transformers' options and defaults (no ASCII escapes, no HTML escapes),
    so a tool schema or call renders to the same characters."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@cache
def _compile(template: str, max_chars: int) -> jinja2.Template:
    env = _BoundedSandbox(
        max_chars,
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", GenerationSpans],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env.from_string(template)


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """TemplateError in the main thread once ``seconds`` have passed (a template that loops);
    a timer armed before (by someone else) is restored, less the time spent here."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise TemplateError(
            f"the chat template ran past data.template_timeout_s ({seconds:g} s); stopped"
        )

    handler = signal.signal(signal.SIGALRM, expire)
    earlier, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        left, _ = signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, handler)
        if earlier:
            signal.setitimer(signal.ITIMER_REAL, max(earlier - (seconds - left), 1e-6), interval)


def _render(template: str, limits: TemplateLimits, variables: dict[str, Any]) -> str:
    """The template's output, within ``limits``; TemplateError for any failure: a template is
    code, and whatever it raises (SecurityError, UndefinedError, ZeroDivisionError, ...) is a
    bad input, said in one line."""
    pieces, size = [], 0
    try:
        with _deadline(limits.timeout_s):
            for piece in _compile(template, limits.max_chars).generate(**variables):
                size += len(piece)
                if size > limits.max_chars:
                    raise TemplateError(
                        f"the chat template wrote over data.max_template_chars "
                        f"({limits.max_chars}) characters; stopped"
                    )
                pieces.append(piece)
    except TemplateError:
        raise
    except Exception as error:
        raise TemplateError(f"the chat template failed: {type(error).__name__}: {error}") from None
    return "".join(pieces)


def render_chat(
    template: str,
    messages: Sequence[Message],
    add_generation_prompt: bool = False,
    *,
    tools: Sequence[Tool] | None = None,
    limits: TemplateLimits = DEFAULT_LIMITS,
    **extra: Any,
) -> str:
    """The conversation as text, like ``apply_chat_template(..., tools=tools, tokenize=False)``;
    ``extra`` are more template variables (a tokenizer's ``special_tokens``)."""
    return render_spans(
        template, messages, add_generation_prompt, tools=tools, limits=limits, **extra
    )[0]


def render_spans(
    template: str,
    messages: Sequence[Message],
    add_generation_prompt: bool = False,
    *,
    tools: Sequence[Tool] | None = None,
    limits: TemplateLimits = DEFAULT_LIMITS,
    **extra: Any,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans [start, end) of its ``{% generation %}``
    blocks (none when the template has no such block)."""
    if any(SPAN_START in text or SPAN_END in text for text in _strings([messages, tools])):
        raise ValueError("a message or tool holds a private-use character U+E000/U+E001")
    variables = {"documents": None, **extra, "tools": None if tools is None else list(tools)}
    variables |= {"messages": list(messages), "add_generation_prompt": add_generation_prompt}
    marked = _render(template, limits, variables)
    texts, spans, length, start = [], [], 0, 0
    for part in re.split(f"({SPAN_START}|{SPAN_END})", marked):
        if part == SPAN_START:
            start = length
        elif part == SPAN_END:
            spans.append((start, length))
        else:
            texts.append(part)
            length += len(part)
    return "".join(texts), spans


def _strings(value: Any) -> Iterator[str]:
    """Every string inside nested lists and dicts (keys too)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def load_chat_template(path: str | None, tokenizer_folder: str | None) -> str:
    """A template file (``path``), else the tokenizer folder's, else the built-in one.

    A folder's template is ``chat_template.jinja`` or ``tokenizer_config.json``'s
    ``chat_template`` field, where ``transformers`` keeps it; either must lie inside the
    folder (UnsafePath for a symlink leading out).
    """
    if path is not None:
        return Path(path).read_text()
    folder = Path(tokenizer_folder) if tokenizer_folder is not None else None
    if folder is not None and folder.is_dir():
        if (folder / "chat_template.jinja").is_file():
            return inside(folder, "chat_template.jinja").read_text()
        if (folder / "tokenizer_config.json").is_file():
            config_path = inside(folder, "tokenizer_config.json")
            try:
                template = json.loads(config_path.read_text()).get("chat_template")
            except (ValueError, AttributeError):
                raise ValueError(f"{config_path}: not a JSON object") from None
            if isinstance(template, str):
                return template
        raise ValueError(
            f"{folder}: no chat template (chat_template.jinja or tokenizer_config.json's "
            "chat_template); give one with --data.chat_template FILE"
        )
    return BUILTIN_TEMPLATE


def require_tools_written(
    text: str, messages: Sequence[Message], tools: Sequence[Tool] | None
) -> None:
    """Raise ValueError when ``text``, a template's rendering of ``messages`` with ``tools``,
    leaves out a tool or tool call's name: a template without tool support would train (or
    prompt for) calls the text never shows."""
    names = [tool["function"]["name"] for tool in tools or ()]
    names += [call["function"]["name"] for m in messages for call in m.get("tool_calls", ())]
    if missing := [name for name in names if name not in text]:
        raise ValueError(
            f"the chat template does not write the tools or tool calls it is given ({missing[0]!r} "
            "is not in its text): give a template with tool support (--data.chat_template)"
        )


def tokenize_chat(
    tokenizer: Tokenizer,
    template: str,
    messages: Sequence[Message],
    train_on_prompt: bool = False,
    limits: TemplateLimits = DEFAULT_LIMITS,
    tools: Sequence[Tool] | None = None,
) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation (with ``tools`` given to the template) and, per
    token, whether it trains: each assistant turn, its tool calls included; never a tool's
    result, which the model reads but does not write.

    Raises ValueError when the template does not render a conversation as the
    concatenation of its turns (the assistant spans could not be found), or leaves out a
    tool or tool call it is given (a template without tool support would train calls the
    text never shows).
    """
    options = {**tokenizer.special_tokens, "tools": tools, "limits": limits}
    full, spans = render_spans(template, messages, **options)
    require_tools_written(full, messages, tools)
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
        prompt = render_chat(template, messages[:i], True, **options)
        through = render_chat(template, messages[: i + 1], **options)
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
    """``value`` as a list of messages, or RecordError at ``where`` naming the field.

    Each has a ``role`` among CHAT_ROLES and a string ``content``, which an assistant turn
    with ``tool_calls`` may leave out or null; a ``tool`` message may have a string ``name``
    and ``tool_call_id``. Other fields are dropped.
    """
    if not isinstance(value, list) or not value:
        raise RecordError(f"{where}: {field!r} must be a non-empty list of messages")
    messages = []
    for j, message in enumerate(value):
        at = f"{where}: {field}[{j}]"
        if not isinstance(message, dict):
            raise RecordError(f"{at} is not an object")
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise RecordError(f"{at}.role is {role!r}; expected one of {CHAT_ROLES}")
        checked: Message = {"role": role, "content": content}
        if role == "assistant" and "tool_calls" in message:
            checked["tool_calls"] = _check_tool_calls(message["tool_calls"], f"{at}.tool_calls")
        if not (isinstance(content, str) or (content is None and "tool_calls" in checked)):
            raise RecordError(f"{at}.content must be a string")
        for key in ("name", "tool_call_id") if role == "tool" else ():
            if key in message:
                if not isinstance(message[key], str):
                    raise RecordError(f"{at}.{key} must be a string")
                checked[key] = message[key]
        messages.append(checked)
    return messages


def _check_tool_calls(value: Any, at: str) -> list[dict[str, Any]]:
    """An assistant's ``tool_calls`` in the OpenAI / transformers form: ``[{"type": "function",
    "function": {"name": ..., "arguments": {...} or a JSON object as a string}}]`` (an ``id``
    kept when given); RecordError naming ``at[k]`` and the field otherwise."""
    if not isinstance(value, list) or not value:
        raise RecordError(f"{at} must be a non-empty list of calls")
    for k, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise RecordError(
                f'{at}[{k}] must be {{"type": "function", "function": {{"name": ..., '
                '"arguments": {...}}}'
            )
        if call.get("type", "function") != "function":
            raise RecordError(f"{at}[{k}].type is {call['type']!r}; expected 'function'")
        if not isinstance(call.get("id", ""), str):
            raise RecordError(f"{at}[{k}].id must be a string")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise RecordError(f"{at}[{k}].function.name must be a non-empty string")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise RecordError(
                    f"{at}[{k}].function.arguments is a string that is not JSON"
                ) from None
        if not isinstance(arguments, dict):
            raise RecordError(f"{at}[{k}].function.arguments must be an object (or its JSON)")
    return value


def check_tools(value: Any, where: str, field: str = "tools") -> list[Tool] | None:
    """A record's ``tools`` (None when absent): function descriptions as transformers takes
    them, ``{"type": "function", "function": {"name": ..., "description": ..., "parameters":
    {JSON schema}}}``; RecordError at ``where`` naming the field otherwise."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise RecordError(f"{where}: {field!r} must be a list of function descriptions")
    for k, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise RecordError(
                f'{where}: {field}[{k}] must be {{"type": "function", "function": {{"name": ..., '
                '"description": ..., "parameters": {...}}}'
            )
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise RecordError(f"{where}: {field}[{k}].function.name must be a non-empty string")
        if not isinstance(function.get("description", ""), str):
            raise RecordError(f"{where}: {field}[{k}].function.description must be a string")
        if not isinstance(function.get("parameters", {}), dict):
            raise RecordError(
                f"{where}: {field}[{k}].function.parameters must be a JSON schema object"
            )
    return value


def read_jsonl(
    path: str, limit: int | None = None, max_bytes: int = Data.max_record_bytes
) -> list[tuple[str, dict[str, Any]]]:
    """The records of a JSONL file (the first ``limit`` when given), each with its
    ``file:line`` for error messages. A line longer than ``max_bytes`` is refused as it is
    read, before it is parsed (``data.max_record_bytes``)."""
    records: list[tuple[str, dict[str, Any]]] = []
    with Path(path).open("rb") as file:
        for lineno, line in enumerate(iter(lambda: file.readline(max_bytes + 1), b""), start=1):
            if limit is not None and len(records) == limit:
                break
            where = f"{path}:{lineno}"
            if len(line.removesuffix(b"\n")) > max_bytes:
                raise RecordError(f"{where}: {record_too_long(max_bytes)}")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
                raise RecordError(f"{where}: invalid JSON ({error})") from None
            if not isinstance(record, dict):
                raise RecordError(f"{where}: expected a JSON object, got {type(record).__name__}")
            records.append((where, record))
    if not records:
        raise RecordError(f"{path}: no records")
    return records
