"""Data: sources (files, built-in tasks) -> formats (text, sft, preference, prompt) ->
packing -> the stateful, per-rank batch loader (``temper.data.stream``)."""

from temper.data.chat import render_chat, tokenize_chat
from temper.data.loader import BatchLoader, build_loader, build_text_loader, text_dataset
from temper.data.preference import preference_dataset, read_preference_records
from temper.data.sft import read_sft_records, sft_dataset
from temper.data.sources import open_source
from temper.data.stream import LaneStream, merge_states
from temper.data.synthetic import synthetic_document
from temper.data.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "BatchLoader",
    "LaneStream",
    "Tokenizer",
    "build_loader",
    "build_text_loader",
    "load_tokenizer",
    "merge_states",
    "open_source",
    "preference_dataset",
    "read_preference_records",
    "read_sft_records",
    "render_chat",
    "sft_dataset",
    "synthetic_document",
    "text_dataset",
    "tokenize_chat",
]
