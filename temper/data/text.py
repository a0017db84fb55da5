"""The text format (pretraining): a document's tokens followed by EOS, packed continuously.

A record holds ``text`` (tokenized here) or ``input_ids`` (a pretokenized shard's document,
taken as is). Rows are ``TokenPacker``'s: ``seq_len + 1`` tokens of the lane's stream,
consecutive rows sharing one token; with ``isolate_documents`` each row also carries
per-document ``position_ids`` and no label crosses a document boundary.
"""

from __future__ import annotations

from temper.data.packing import TokenPacker
from temper.data.sources import Record
from temper.data.tokenizer import Tokenizer


class TextFormat:
    """Records to documents' tokens (see the module docstring)."""

    required = (("text", "input_ids"),)
    shuffle = False
    """Documents are read in the files' order, epoch after epoch."""

    def __init__(self, tokenizer: Tokenizer, seq_len: int, isolate_documents: bool = False) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.isolate_documents = isolate_documents

    def encode(self, record: Record, where: str) -> tuple[list[int], str | None]:
        if "input_ids" in record:
            return [*record["input_ids"].tolist(), self.tokenizer.eos_id], None
        if "text" not in record:
            raise ValueError(f"{where}: record has no field 'text'")
        text = record["text"]
        if not isinstance(text, str):
            raise ValueError(f"{where}: field 'text' is {type(text).__name__}, expected a string")
        return [*self.tokenizer.encode(text), self.tokenizer.eos_id], None

    def tokens(self, sample: list[int]) -> int:
        return len(sample)

    def packer(self) -> TokenPacker:
        return TokenPacker(self.seq_len, self.tokenizer.eos_id, self.isolate_documents)
