"""Train the built-in byte-level BPE tokenizer on the synthetic task stream.

``python -m temper.assets.make_tokenizer`` rewrites ``temper/assets/tokenizer.json``. The
result is deterministic and a unit test checks the shipped file against it, so rerun this
whenever the synthetic generator changes.
"""

import argparse
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from temper.data.synthetic import synthetic_document
from temper.data.tokenizer import EOS_TOKEN, PAD_TOKEN

CHAT_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, *CHAT_TOKENS)
VOCAB_SIZE = 2048
TRAINING_SEED = 0
# Enough for every number, letter and grammar word to appear many times.
TRAINING_DOCUMENTS = 20_000
DEFAULT_OUTPUT = Path(__file__).with_name("tokenizer.json")


def build_tokenizer() -> tokenizers.Tokenizer:
    """Byte-level BPE: any UTF-8 text encodes, and decoding gives the exact text back."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    documents = (synthetic_document(TRAINING_SEED, i) for i in range(TRAINING_DOCUMENTS))
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    output = parser.parse_args().output
    tokenizer = build_tokenizer()
    tokenizer.save(str(output))
    print(f"wrote {output} ({tokenizer.get_vocab_size(with_added_tokens=True)} tokens)")


if __name__ == "__main__":
    main()
