"""Formats by name: what ``data.format`` picks, each turning records into rows of a
``temper.data.stream.LaneStream``.

A ``FormatSpec`` is everything the pipeline needs of a format: how to build it from the
config, the built-in task's records when no path is given, how rows make a batch, and what
a source opened from a path needs first (image paths relative to the data file). Formats are
registered by name as objectives are (``register_format``); sft data whose records hold image
parts is read by ``image_sft`` (``format_name``), so one config runs text or image chat data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from temper.config import Config, Data
from temper.data.chat import BUILTIN_TEMPLATE, TemplateLimits, load_chat_template
from temper.data.multimodal import (
    BUILTIN_VL_TEMPLATE,
    ImageFiles,
    ImageFormat,
    collate,
    has_image_parts,
    load_image_processor,
)
from temper.data.preference import PreferenceFormat
from temper.data.prompts import PromptFormat
from temper.data.sft import SFTFormat
from temper.data.shapes import ShapeSource
from temper.data.sources import Source, SyntheticSource
from temper.data.sources.configured import configured_sources
from temper.data.stream import Format
from temper.data.tasks import task_source
from temper.data.text import TextFormat
from temper.data.tokenizer import Tokenizer
from temper.utils.registry import Registry

Row = dict[str, torch.Tensor]


def stack_rows(rows: Sequence[Row]) -> Row:
    """A batch of equal-shaped rows: every key stacked."""
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def as_opened(source: Source, path: str) -> Source:
    """A source opened from ``path``, as the format reads it (most formats: as is)."""
    del path
    return source


@dataclass(frozen=True)
class FormatSpec:
    build: Callable[[Config, Tokenizer], Format]
    """The format for rows of ``training.seq_len``."""
    builtin: Callable[[Config, str], Source]
    """The built-in task's records of a split ("train" or "validation") when no path is set."""
    collate: Callable[[Sequence[Row]], Row] = stack_rows
    """Rows to a batch (image rows, whose pixels differ in size, bring their own)."""
    opened: Callable[[Source, str], Source] = as_opened
    """A source opened from a path (``data.path``, a ``data.sources`` entry), readied."""


FORMATS: Registry[FormatSpec] = Registry("data format")


def register_format(name: str, spec: FormatSpec) -> FormatSpec:
    """Make ``spec`` the format named ``name`` (a user module may add its own)."""
    return FORMATS.add(name, spec)


def is_image_data(data: Data) -> bool:
    """SFT data with images: ``image_sft`` by name, the built-in image task, or files whose
    first records hold image parts (list contents)."""
    if data.format == "image_sft":
        return True
    if data.format != "sft":
        return False
    entries = configured_sources(data)
    if not entries:
        return data.builtin_images
    # A missing or malformed file is not taken for image data: the source check names it.
    try:
        return any(
            Path(entry.path).is_file()
            and has_image_parts(entry.path, max_bytes=data.max_record_bytes)
            for _, entry in entries
        )
    except ValueError:
        return False


def image_paths(data: Data) -> str:
    """The configured paths, for a message about image data ("" for the built-in task)."""
    return ", ".join(entry.path for _, entry in configured_sources(data))


def format_name(data: Data) -> str:
    """The registered format that reads ``data``: ``data.format``, or ``image_sft`` for sft
    data with images."""
    return "image_sft" if is_image_data(data) else data.format


def format_spec(data: Data) -> FormatSpec:
    return FORMATS.get(format_name(data))


def build_format(config: Config, tokenizer: Tokenizer) -> Format:
    """The format that reads ``config.data``, for rows of ``training.seq_len``."""
    return format_spec(config.data).build(config, tokenizer)


def _folder(config: Config) -> str | None:
    """Where the chat template and image processor come from: the tokenizer's or model's."""
    return config.data.tokenizer_path or config.model.hf_path


def _task_split(split: str) -> Literal["train", "eval"]:
    return "train" if split == "train" else "eval"


def _text(config: Config, tokenizer: Tokenizer) -> Format:
    return TextFormat(tokenizer, config.training.seq_len, config.data.isolate_documents)


def _synthetic(config: Config, split: str) -> Source:
    seed = config.training.seed
    return SyntheticSource(seed if split == "train" else seed + 1_000_003)


def _sft(config: Config, tokenizer: Tokenizer) -> Format:
    data = config.data
    return SFTFormat(
        tokenizer,
        load_chat_template(data.chat_template, _folder(config)),
        config.training.seq_len,
        train_on_prompt=data.train_on_prompt,
        pack=data.pack,
        pack_buffer=data.pack_buffer,
        policy=data.max_length_policy,
        limits=TemplateLimits.of(data),
    )


def _preference(config: Config, tokenizer: Tokenizer) -> Format:
    data = config.data
    template = load_chat_template(data.chat_template, _folder(config))
    limits = TemplateLimits.of(data)
    return PreferenceFormat(
        tokenizer, template, config.training.seq_len, data.max_length_policy, limits
    )


def _prompt(config: Config, tokenizer: Tokenizer) -> Format:
    """Prompt rows leave room for the completion the objective samples."""
    data = config.data
    template = load_chat_template(data.chat_template, _folder(config))
    width = config.training.seq_len - config.objective.completion_tokens()
    return PromptFormat(tokenizer, template, width, TemplateLimits.of(data))


def _image_sft(config: Config, tokenizer: Tokenizer) -> Format:
    """The built-in template becomes its image-part variant; the image processor is the
    folder's, else the built-in one."""
    data, folder = config.data, _folder(config)
    template = load_chat_template(data.chat_template, folder)
    if template == BUILTIN_TEMPLATE:
        template = BUILTIN_VL_TEMPLATE
    return ImageFormat(
        tokenizer,
        template,
        load_image_processor(folder),
        config.training.seq_len,
        train_on_prompt=data.train_on_prompt,
        pack=data.pack,
        limits=TemplateLimits.of(data),
    )


def _tasks(name: str) -> Callable[[Config, str], Source]:
    def builtin(config: Config, split: str) -> Source:
        data = config.data
        return task_source(name, config.training.seed, _task_split(split), data.builtin_examples)

    return builtin


def _shapes(config: Config, split: str) -> Source:
    seed, count = config.training.seed, config.data.builtin_examples
    return ShapeSource(seed, _task_split(split), count)


def _image_files(source: Source, path: str) -> Source:
    """Image paths are relative to the data file (or the folder of files)."""
    root = Path(path)
    return ImageFiles(source, root.parent if root.is_file() else root)


register_format("text", FormatSpec(_text, _synthetic))
register_format("sft", FormatSpec(_sft, _tasks("sft")))
register_format("preference", FormatSpec(_preference, _tasks("preference")))
register_format("prompt", FormatSpec(_prompt, _tasks("prompt")))
register_format("image_sft", FormatSpec(_image_sft, _shapes, collate, _image_files))
