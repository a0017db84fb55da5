"""Tokenizer, document sources, packing and the stateful batch loader."""

from temper.data.chat import render_chat, tokenize_chat
from temper.data.loader import BatchLoader, build_text_loader
from temper.data.preference import preference_dataset, read_preference_records
from temper.data.sft import read_sft_records, sft_dataset
from temper.data.synthetic import synthetic_document
from temper.data.text import TextDataset
from temper.data.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "BatchLoader",
    "TextDataset",
    "Tokenizer",
    "build_text_loader",
    "preference_dataset",
    "read_preference_records",
    "read_sft_records",
    "render_chat",
    "sft_dataset",
    "tokenize_chat",
    "load_tokenizer",
    "synthetic_document",
]
