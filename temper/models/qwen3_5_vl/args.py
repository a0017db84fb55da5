"""Qwen3.5 vision-language arguments: a Qwen3.5 (or Qwen3.5-MoE) language model's, plus its
vision tower's and the special tokens that mark images."""

from dataclasses import dataclass, field

from temper.data.vision_tokens import BUILTIN_VISION_TOKENS
from temper.models.layers.vision import VisionArgs
from temper.models.qwen3_5.args import FLAVORS as TEXT_FLAVORS
from temper.models.qwen3_5.args import Qwen3_5Args
from temper.models.qwen3_5_moe.args import FLAVORS as MOE_FLAVORS
from temper.models.qwen3_5_moe.args import Qwen3_5MoeArgs


@dataclass(kw_only=True)
class VisionTokens:
    """Token ids of the image placeholder and the markers around each image."""

    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054


@dataclass(kw_only=True)
class Qwen3_5VLArgs(Qwen3_5Args, VisionTokens):
    vision: VisionArgs = field(default_factory=lambda: VisionArgs(**PUBLISHED_VISION))


@dataclass(kw_only=True)
class Qwen3_5MoeVLArgs(Qwen3_5MoeArgs, VisionTokens):
    vision: VisionArgs = field(default_factory=lambda: VisionArgs(**PUBLISHED_VISION))


PUBLISHED_VISION = {
    "dim": 1152,
    "n_layers": 27,
    "n_heads": 16,
    "ffn_hidden_dim": 4304,
    "out_dim": 4096,
}
"""transformers' Qwen3_5VisionConfig defaults (the 9B's out_dim)."""

# The debug tower: 16-pixel patches (two frames), merged 2 x 2, into the debug language model;
# image tokens are the built-in tokenizer's last ids, which plain text never produces.
DEBUG_VISION = VisionArgs(
    dim=64, n_layers=2, n_heads=4, ffn_hidden_dim=128, out_dim=128, n_position_embeddings=64
)
DEBUG_TOKENS = {
    "image_token_id": BUILTIN_VISION_TOKENS.image,
    "video_token_id": 2046,
    "vision_start_token_id": BUILTIN_VISION_TOKENS.start,
    "vision_end_token_id": BUILTIN_VISION_TOKENS.end,
}


def _text_fields(args: Qwen3_5Args) -> dict:
    return {f: getattr(args, f) for f in args.__dataclass_fields__}


FLAVORS: dict[str, Qwen3_5VLArgs] = {
    "debug": Qwen3_5VLArgs(
        **_text_fields(TEXT_FLAVORS["debug"]), **DEBUG_TOKENS, vision=DEBUG_VISION
    ),
    "9b": Qwen3_5VLArgs(**_text_fields(TEXT_FLAVORS["9b"])),
}

MOE_FLAVORS_VL: dict[str, Qwen3_5MoeVLArgs] = {
    "debug": Qwen3_5MoeVLArgs(
        **_text_fields(MOE_FLAVORS["debug"]), **DEBUG_TOKENS, vision=DEBUG_VISION
    ),
}
