"""Pretokenize a text corpus into a ``.tokens`` shard for continued pretraining.

    python -m temper.data.prepare corpus/ shard.tokens --tokenizer models/my-model
    python -m temper.data.prepare docs.parquet shard.tokens --text_field content

The input is anything ``data.path`` reads (``.txt``, ``.jsonl``, ``.jsonl.gz``, parquet,
an Arrow folder, a folder of them); each record's text field becomes one document, in the
input's order. Training then reads the shard by memory map (``--data.path shard.tokens``),
with no tokenization at all; the text format closes each document with EOS.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

from temper.data.sources import Source, open_source
from temper.data.sources.tokens import write_tokens
from temper.data.tokenizer import Tokenizer, load_tokenizer

CHUNK = 1024
"""Documents tokenized together (in parallel) at a time."""


def documents(source: Source, tokenizer: Tokenizer, text_field: str) -> Iterator[list[int]]:
    """Token ids of each record's ``text_field``, in order; a bad record fails naming it."""
    count = source.num_records or 0
    for start in range(0, count, CHUNK):
        texts = []
        for index in range(start, min(start + CHUNK, count)):
            text = source.record(index).get(text_field)
            if not isinstance(text, str):
                raise ValueError(f"{source.where(index)}: field {text_field!r} is not a string")
            texts.append(text)
        yield from tokenizer.encode_batch(texts)


def prepare(input: str, output: str, tokenizer_path: str | None, text_field: str) -> int:
    """Write ``output`` from ``input``; returns the number of documents."""
    tokenizer = load_tokenizer(tokenizer_path)
    source = open_source(input, text_field)
    return write_tokens(output, documents(source, tokenizer, text_field), tokenizer.vocab_size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m temper.data.prepare", description=__doc__)
    parser.add_argument("input", help="a text corpus: file or folder (what data.path reads)")
    parser.add_argument("output", help="the .tokens shard to write")
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer.json or its folder; default: the built-in"
    )
    parser.add_argument("--text_field", default="text", help="the field holding a document")
    args = parser.parse_args(argv)
    if not args.output.endswith(".tokens"):
        parser.error(f"output {args.output}: a token shard's name ends in .tokens")
    try:
        count = prepare(args.input, args.output, args.tokenizer, args.text_field)
    except (OSError, ValueError) as error:
        print(f"temper.data.prepare: {error}", file=sys.stderr)
        return 2
    print(f"temper.data.prepare: wrote {count} documents to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
