"""Batches from a stateful row dataset; checkpointing the loader checkpoints the dataset."""

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch

from temper.data.text import TextDataset
from temper.data.tokenizer import Tokenizer


class StatefulDataset(Protocol):
    """Rows of equal-shaped tensors whose position is saved and restored by state dict, and
    counts of what it did to the data (truncated or dropped samples), logged as
    ``data_<name>``."""

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
        collate: Callable[[Sequence[dict[str, torch.Tensor]]], dict[str, torch.Tensor]]
        | None = None,
    ) -> None:
        """``collate`` turns rows into a batch; None stacks every key (image rows, whose
        pixels differ in size, bring their own: ``temper.data.multimodal.collate``)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate = collate or stack_rows

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        rows = iter(self.dataset)
        while True:
            batch = list(itertools.islice(rows, self.batch_size))
            if len(batch) < self.batch_size:
                return
            yield self.collate(batch)

    @property
    def stats(self) -> dict[str, int]:
        """The dataset's counts (see ``StatefulDataset``)."""
        return self.dataset.stats

    def state_dict(self) -> dict:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state)


def stack_rows(rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


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
    """The pretraining loader for one DP rank: synthetic tasks (path None) or text files;
    ``isolate_documents`` adds per-document ``position_ids`` (see ``TextDataset``)."""
    dataset = TextDataset(
        tokenizer,
        seq_len,
        path=path,
        text_field=text_field,
        seed=seed,
        dp_rank=dp_rank,
        dp_world=dp_world,
        isolate_documents=isolate_documents,
    )
    return BatchLoader(dataset, batch_size)
