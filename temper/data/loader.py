"""From the config to batches: the split's sources (``temper.data.sources.configured``)
through the format ``data.format`` names (``temper.data.formats``) on one lane stream
(``temper.data.stream``), stacked into batches.

``build_loader`` is what the trainer calls; ``build_validation_loader`` gives the held-out
batches, ``validation_prompts`` the held-out prompts a generation check answers. The checks
before a run are ``temper.data.checks``'.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch

from temper.config import Config
from temper.data.batch import REAL_TOKENS
from temper.data.chat import TemplateLimits, check_messages, load_chat_template, render_chat
from temper.data.checks import check_data as check_data
from temper.data.checks import check_data_config as check_data_config
from temper.data.formats import format_spec
from temper.data.formats import stack_rows as stack_rows
from temper.data.prompts import record_prompt
from temper.data.sources import SyntheticSource
from temper.data.sources.configured import open_path, open_split, source_label
from temper.data.stream import LaneStream
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
        pixels differ in size, bring their own: the format's ``FormatSpec.collate``)."""
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
    source = SyntheticSource(seed) if path is None else open_path(path, text_field, {}, tokenizer)
    return LaneStream(
        [source],
        TextFormat(tokenizer, seq_len, isolate_documents),
        labels=["builtin" if path is None else source_label(path)],
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
    spec = format_spec(config.data)
    sources = open_split(config, tokenizer, split, spec.builtin, spec.opened)
    stream = LaneStream(
        sources.sources,
        spec.build(config, tokenizer),
        weights=sources.weights,
        labels=sources.labels,
        lanes=rows_per_step(config, dp_world),
        dp_rank=dp_rank,
        dp_world=dp_world,
        micro_batch=config.training.local_batch_size,
        seed=config.training.seed,
    )
    return BatchLoader(stream, config.training.local_batch_size, sum_counts, spec.collate)


def build_loader(
    config: Config,
    tokenizer: Tokenizer,
    dp_rank: int,
    dp_world: int,
    sum_counts: Callable[[dict[str, int]], dict[str, int]] | None = None,
) -> BatchLoader:
    """This data rank's training batches (see ``temper.data.stream``); ``sum_counts`` makes
    its logged counts the whole group's (``BatchLoader.stats``)."""
    return _loader(config, tokenizer, dp_rank, dp_world, "train", sum_counts)


def build_validation_loader(
    config: Config, tokenizer: Tokenizer, dp_rank: int, dp_world: int
) -> BatchLoader:
    """This data rank's validation batches, laid out as the training ones."""
    return _loader(config, tokenizer, dp_rank, dp_world, "validation")


def validation_prompts(
    config: Config, tokenizer: Tokenizer, dp_rank: int, dp_world: int
) -> list[tuple[list[int], dict]]:
    """This rank's share of the first ``validation.generate`` held-out records as (rendered
    prompt ids, prompt record, its reference under ``"answer"``, as rewards take it): rank
    ``r`` takes records ``r, r + dp_world, ...``. An sft record's answer is its last message,
    which must be the assistant's."""
    data = config.data
    template = load_chat_template(data.chat_template, data.tokenizer_path or config.model.hf_path)
    spec = format_spec(data)
    sources = open_split(config, tokenizer, "validation", spec.builtin, spec.opened).sources
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
