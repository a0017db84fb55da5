"""From the config to batches: sources -> format -> stream (lanes, packing) -> batches.

``build_loader`` is what the trainer calls; ``build_validation_loader`` gives the held-out
batches; ``check_data`` is the pre-flight look at the first records of every source.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from temper.config import Config, ConfigError, Data, DataSource, check_positive, register_rule
from temper.data.batch import REAL_TOKENS
from temper.data.chat import TemplateLimits, check_messages, load_chat_template, render_chat
from temper.data.multimodal import (
    build_image_dataset,
    collate,
    has_image_parts,
    read_image_records,
)
from temper.data.preference import PreferenceFormat
from temper.data.prompts import PromptFormat, record_prompt
from temper.data.sft import SFTFormat
from temper.data.sources import RenamedSource, SliceSource, Source, SyntheticSource, open_source
from temper.data.sources.base import RecordError
from temper.data.stream import Format, LaneStream, check_fields
from temper.data.tasks import task_source
from temper.data.text import TextFormat
from temper.data.tokenizer import Tokenizer


class StatefulDataset(Protocol):
    """Rows of equal-shaped tensors whose position is saved and restored by state dict, and
    counts of what it did to the data, logged as ``data_<name>``."""

    stats: dict[str, int]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class BatchLoader:
    """Stacks ``batch_size`` consecutive rows; a finite dataset ends at its last full batch.

    The position lives in the dataset, so after ``load_state_dict`` the next batch is exactly
    the one the saved run would have produced next.
    """

    def __init__(
        self,
        dataset: StatefulDataset,
        batch_size: int,
        sum_counts: Callable[[dict[str, int]], dict[str, int]] | None = None,
        collate: Callable[[Sequence[dict[str, torch.Tensor]]], dict[str, torch.Tensor]]
        | None = None,
    ) -> None:
        """``collate`` turns rows into a batch; None stacks every key (image rows, whose
        pixels differ in size, bring their own: ``temper.data.multimodal.collate``)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.sum_counts = sum_counts
        self.collate = collate or stack_rows

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        rows = iter(self.dataset)
        while True:
            batch = list(itertools.islice(rows, self.batch_size))
            if len(batch) < self.batch_size:
                return
            yield trim_padding(self.collate(batch))

    @property
    def stats(self) -> dict[str, int]:
        """The dataset's counts (see ``StatefulDataset``), summed over the data-parallel ranks
        by ``sum_counts`` when given (a collective: every rank reads them together)."""
        stats = self.dataset.stats
        return stats if self.sum_counts is None else self.sum_counts(stats)

    def state_dict(self) -> dict:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state)


PAD_MULTIPLE = 64
"""A trimmed batch's width is a multiple of this (or ``seq_len``): a few distinct shapes, so
compiled blocks and the allocator's cached blocks are reused, at most 63 padded positions."""


def trim_padding(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``batch`` without the right padding all its rows share: rows that say how many of
    their positions are real (``REAL_TOKENS``: SFT rows, preference pairs, both sides alike,
    as DPO concatenates them) are cut to the longest, rounded up to ``PAD_MULTIPLE``. The cut
    positions are padding: no label, and after every real token (causal attention), or a
    document of their own (packed rows), so the loss and gradients are those of the full
    width, computed on fewer positions."""
    real = [value for key, value in batch.items() if key.endswith(REAL_TOKENS)]
    if not real:
        return batch
    width = next(v for k, v in batch.items() if k.endswith("input_ids")).shape[1]
    longest = max(int(r.max()) for r in real)
    keep = min(width, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE)
    return {k: v[:, :keep] if v.dim() == 2 and v.shape[1] == width else v for k, v in batch.items()}


def stack_rows(rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def text_dataset(
    tokenizer: Tokenizer,
    seq_len: int,
    *,
    path: str | None = None,
    text_field: str = "text",
    seed: int = 0,
    lanes: int = 1,
    dp_rank: int = 0,
    dp_world: int = 1,
    isolate_documents: bool = False,
) -> LaneStream:
    """Packed text rows of ``path`` (any kind ``open_source`` reads) or, with no path, of the
    built-in synthetic stream for ``seed``."""
    source = SyntheticSource(seed) if path is None else _open(path, text_field, {}, tokenizer)
    return LaneStream(
        [source],
        TextFormat(tokenizer, seq_len, isolate_documents),
        labels=["builtin" if path is None else _label(path)],
        lanes=lanes,
        dp_rank=dp_rank,
        dp_world=dp_world,
        seed=seed,
    )


def build_text_loader(
    tokenizer: Tokenizer,
    seq_len: int,
    batch_size: int,
    *,
    path: str | None = None,
    text_field: str = "text",
    seed: int = 0,
    dp_rank: int = 0,
    dp_world: int = 1,
    isolate_documents: bool = False,
) -> BatchLoader:
    """The pretraining loader for one DP rank, one lane per row of a step's global batch."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    dataset = text_dataset(
        tokenizer,
        seq_len,
        path=path,
        text_field=text_field,
        seed=seed,
        lanes=batch_size * dp_world,
        dp_rank=dp_rank,
        dp_world=dp_world,
        isolate_documents=isolate_documents,
    )
    return BatchLoader(dataset, batch_size)


def _open(
    path: str,
    text_field: str,
    fields: dict[str, str],
    tokenizer: Tokenizer,
    max_record_bytes: int = Data.max_record_bytes,
) -> Source:
    fields = {"text": text_field, **fields}
    source = open_source(path, fields["text"], tokenizer.vocab_size, max_record_bytes)
    rename = {name: column for name, column in fields.items() if name != column}
    return RenamedSource(source, rename) if rename else source


def _label(path: str) -> str:
    name = Path(path.rstrip("/")).name.split(".")[0]
    return re.sub(r"[^A-Za-z0-9_]+", "_", name) or "source"


def configured_sources(data: Data) -> list[tuple[str, DataSource]]:
    """(flag prefix, source) of each configured source: ``data.sources``, else ``data.path``."""
    if data.sources:
        return [(f"data.sources.{i}", source) for i, source in enumerate(data.sources)]
    if data.path is not None:
        return [("data.path", DataSource(path=data.path))]
    return []


class Sources(NamedTuple):
    sources: list[Source]
    weights: list[float]
    labels: list[str]
    """Names of their logged counts: the file names, made unique with the index."""
    flags: list[str]
    """The flag each comes from, for error messages (``data.sources.1``)."""


def _sources(config: Config, tokenizer: Tokenizer, split: str) -> Sources:
    """The sources of ``split`` ("train" or "validation")."""
    data, validation, seed = config.data, config.validation, config.training.seed
    if split == "validation" and validation.path is not None:
        try:
            source = _open(validation.path, data.text_field, {}, tokenizer, data.max_record_bytes)
        except (OSError, ValueError) as error:
            raise type(error)(f"validation.path {validation.path}: {error}") from None
        return Sources([source], [1.0], ["validation"], [f"validation.path {validation.path}"])
    entries = configured_sources(data)
    if not entries:
        if data.format == "text":
            source = SyntheticSource(seed if split == "train" else seed + 1_000_003)
        else:
            task_split = "train" if split == "train" else "eval"
            source = task_source(data.format, seed, task_split, data.builtin_examples)
        return Sources([source], [1.0], ["builtin"], ["the built-in tasks"])
    found = Sources([], [], [], [])
    for flag, entry in entries:
        try:
            source = _open(
                entry.path, data.text_field, entry.fields, tokenizer, data.max_record_bytes
            )
        except (OSError, ValueError) as error:
            raise type(error)(f"{flag} {entry.path}: {error}") from None
        if validation.fraction > 0:
            n = source.num_records or 0
            held = math.ceil(validation.fraction * n)
            if held >= n:
                raise ValueError(f"{flag} {entry.path}: validation.fraction leaves no records")
            part = (0, n - held) if split == "train" else (n - held, n)
            source = SliceSource(source, *part, f"{source.name} ({split})")
        found.sources.append(source)
        found.weights.append(entry.weight)
        found.labels.append(entry.name or _label(entry.path))
        found.flags.append(f"{flag} {entry.path}")
    repeated = {label for label in found.labels if found.labels.count(label) > 1}
    found.labels[:] = [f"{x}_{i}" if x in repeated else x for i, x in enumerate(found.labels)]
    return found


def build_format(config: Config, tokenizer: Tokenizer) -> Format:
    """The format ``data.format`` names, for rows of ``training.seq_len`` (prompt rows leave
    room for the completion the objective samples)."""
    data, seq_len = config.data, config.training.seq_len
    if data.format == "text":
        return TextFormat(tokenizer, seq_len, data.isolate_documents)
    template = load_chat_template(data.chat_template, data.tokenizer_path or config.model.hf_path)
    limits = TemplateLimits.of(data)
    if data.format == "sft":
        return SFTFormat(
            tokenizer,
            template,
            seq_len,
            train_on_prompt=data.train_on_prompt,
            pack=data.pack,
            pack_buffer=data.pack_buffer,
            policy=data.max_length_policy,
            limits=limits,
        )
    if data.format == "preference":
        return PreferenceFormat(tokenizer, template, seq_len, data.max_length_policy, limits)
    width = seq_len - config.objective.completion_tokens()
    return PromptFormat(tokenizer, template, width, limits)


def rows_per_step(config: Config, dp_world: int) -> int:
    """Rows of one optimizer step over all data-parallel ranks: the stream's lanes."""
    training = config.training
    if training.global_batch_size == -1:
        return training.local_batch_size * dp_world
    return training.global_batch_size


def _loader(
    config: Config,
    tokenizer: Tokenizer,
    dp_rank: int,
    dp_world: int,
    split: str,
    sum_counts: Callable[[dict[str, int]], dict[str, int]] | None = None,
) -> BatchLoader:
    sources = _sources(config, tokenizer, split)
    stream = LaneStream(
        sources.sources,
        build_format(config, tokenizer),
        weights=sources.weights,
        labels=sources.labels,
        lanes=rows_per_step(config, dp_world),
        dp_rank=dp_rank,
        dp_world=dp_world,
        micro_batch=config.training.local_batch_size,
        seed=config.training.seed,
    )
    return BatchLoader(stream, config.training.local_batch_size, sum_counts)


def build_loader(
    config: Config,
    tokenizer: Tokenizer,
    dp_rank: int,
    dp_world: int,
    sum_counts: Callable[[dict[str, int]], dict[str, int]] | None = None,
) -> BatchLoader:
    """This data rank's training batches (see ``temper.data.stream``); ``sum_counts`` makes
    its logged counts the whole group's (``BatchLoader.stats``). Image chat data has a
    stream of its own (``temper.data.multimodal``)."""
    if is_image_data(config.data):
        training = config.training
        dataset = build_image_dataset(
            config.data,
            tokenizer,
            training.seq_len,
            seed=training.seed,
            dp_rank=dp_rank,
            dp_world=dp_world,
            folder=config.data.tokenizer_path or config.model.hf_path,
        )
        return BatchLoader(dataset, training.local_batch_size, collate=collate)
    return _loader(config, tokenizer, dp_rank, dp_world, "train", sum_counts)


def is_image_data(data: Data) -> bool:
    """SFT data with images: the built-in image task, or a file whose records hold image
    parts (list contents)."""
    if data.format != "sft":
        return False
    if data.path is None:
        return data.builtin_images
    # A missing or malformed file is not taken for image data: the source check names it.
    try:
        return Path(data.path).is_file() and has_image_parts(
            data.path, max_bytes=data.max_record_bytes
        )
    except ValueError:
        return False


def build_validation_loader(
    config: Config, tokenizer: Tokenizer, dp_rank: int, dp_world: int
) -> BatchLoader:
    """This data rank's validation batches, laid out as the training ones."""
    return _loader(config, tokenizer, dp_rank, dp_world, "validation")


def check_data(config: Config, tokenizer: Tokenizer, limit: int) -> None:
    """Open every source (schemas, token ids) and encode its first ``limit`` records: what a
    run would fail on, checked cheaply before it starts. Errors name the flag and the file
    (and line or row)."""
    data = config.data
    if is_image_data(data):
        if data.path is not None:
            records = read_image_records(data.path, limit, data.max_record_bytes)
            roles = {message["role"] for _, messages, _ in records for message in messages}
            if "assistant" not in roles and not data.train_on_prompt:
                raise RecordError(
                    f"data.path {data.path}: {data.path}: {nothing_to_train(len(records))}"
                )
        return
    fmt = build_format(config, tokenizer)
    splits = ["train"] + (["validation"] if config.validation.interval else [])
    for split in splits:
        found = _sources(config, tokenizer, split)
        for source, flag in zip(found.sources, found.flags, strict=True):
            try:
                check_fields(source, fmt)
                count = min(limit, source.num_records or limit)
                kept = [fmt.encode(source.record(i), source.where(i))[0] for i in range(count)]
                if all(sample is None for sample in kept):
                    raise RecordError(f"{source.name}: {nothing_to_train(count)}")
            except ValueError as error:
                raise ValueError(f"{flag}: {error}") from None


def nothing_to_train(count: int) -> str:
    return (
        f"nothing to train on: none of the {count} records checked keeps a trained token (no "
        "assistant turn, every label masked, or too long for training.seq_len)"
    )


@register_rule
def check_data_config(config: Config, world_size: int) -> None:
    """Data and validation fields that only make sense together."""
    data, validation = config.data, config.validation
    if data.sources and data.path is not None:
        raise ConfigError("data.sources and data.path are both set: give one")
    for i, source in enumerate(data.sources):
        if not source.path:
            raise ConfigError(f"data.sources.{i}.path is empty")
        if not source.weight > 0:
            raise ConfigError(f"data.sources.{i}.weight must be > 0, got {source.weight}")
    limits = ("data.template_timeout_s", "data.max_template_chars", "data.max_record_bytes")
    limits += ("data.pack_buffer",)
    check_positive(config, *limits)
    if data.isolate_documents and data.format != "text":
        raise ConfigError(
            "data.isolate_documents is for data.format text (sft packing always isolates)"
        )
    if validation.interval < 0:
        raise ConfigError(f"validation.interval must be >= 0, got {validation.interval}")
    if validation.steps < 1:
        raise ConfigError(f"validation.steps must be >= 1, got {validation.steps}")
    if not 0.0 <= validation.fraction < 1.0:
        raise ConfigError(f"validation.fraction must be in [0, 1), got {validation.fraction}")
    if validation.fraction and validation.path is not None:
        raise ConfigError("validation.fraction and validation.path are both set: give one")
    if validation.fraction and not configured_sources(data):
        raise ConfigError(
            "validation.fraction holds out records of data.path or data.sources; the built-in "
            "tasks validate on their own held-out split"
        )
    if validation.generate < 0 or validation.max_new_tokens < 1:
        raise ConfigError("validation.generate must be >= 0 and validation.max_new_tokens >= 1")
    if validation.generate and data.format not in ("sft", "prompt"):
        raise ConfigError(
            f"validation.generate answers held-out prompts of sft or prompt data, not "
            f"data.format {data.format}"
        )
    if validation.interval and data.format == "prompt" and not validation.generate:
        raise ConfigError(
            "validation.interval: prompt data (grpo) has no loss on fixed batches; set "
            "validation.generate to check greedy answers to held-out prompts"
        )


def validation_prompts(
    config: Config, tokenizer: Tokenizer, dp_rank: int, dp_world: int
) -> list[tuple[list[int], dict]]:
    """This rank's share of the first ``validation.generate`` held-out records as (rendered
    prompt ids, prompt record, its reference under ``"answer"``, as rewards take it): rank
    ``r`` takes records ``r, r + dp_world, ...``. An sft record's answer is its last message,
    which must be the assistant's."""
    data = config.data
    template = load_chat_template(data.chat_template, data.tokenizer_path or config.model.hf_path)
    sources = _sources(config, tokenizer, "validation").sources
    records = [
        (source.record(i), source.where(i))
        for source in sources
        for i in range(min(config.validation.generate, source.num_records or 0))
    ][: config.validation.generate]
    prompts = []
    for record, where in records[dp_rank::dp_world]:
        if data.format == "sft":
            *messages, last = check_messages(record.get("messages"), where)
            if last["role"] != "assistant" or not messages:
                raise ValueError(f"{where}: the last message is not an assistant's answer")
            record = {"prompt": messages, "answer": last["content"], "tools": record.get("tools")}
        messages, answer = record_prompt(record, where)
        limits = TemplateLimits.of(data)
        special = tokenizer.special_tokens
        tools = answer.get("tools")
        text = render_chat(template, messages, True, tools=tools, limits=limits, **special)
        prompts.append((tokenizer.encode(text), answer))
    return prompts
