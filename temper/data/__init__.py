"""Tokenizer, document sources, packing and the stateful batch loader."""

from temper.data.loader import BatchLoader, build_text_loader
from temper.data.synthetic import synthetic_document
from temper.data.text import TextDataset
from temper.data.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "BatchLoader",
    "TextDataset",
    "Tokenizer",
    "build_text_loader",
    "load_tokenizer",
    "synthetic_document",
]
