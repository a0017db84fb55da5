"""The token ids that mark an image in a token sequence: a start marker, one placeholder per
image token (the tower's output rows), an end marker."""

from __future__ import annotations

from dataclasses import dataclass

from temper.data.tokenizer import Tokenizer

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
"""What Qwen-VL chat templates write for an image part; the pipeline expands the pad."""


@dataclass(frozen=True)
class VisionTokenIds:
    start: int
    image: int
    end: int


BUILTIN_VISION_TOKENS = VisionTokenIds(start=2045, image=2047, end=2044)
"""The debug vision-language flavors' ids: above the built-in tokenizer's vocabulary (which
plain text never reaches), inside the debug models' 2048 rows."""


def vision_token_ids(tokenizer: Tokenizer) -> VisionTokenIds:
    """The tokenizer's own vision tokens, or the built-in ids when it has none."""
    ids = [tokenizer.token_id(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")]
    if all(i is None for i in ids):
        return BUILTIN_VISION_TOKENS
    if any(i is None for i in ids):
        raise ValueError(
            "the tokenizer has only some of <|vision_start|>, <|image_pad|>, <|vision_end|>"
        )
    return VisionTokenIds(*ids)
