"""Qwen3.5 vision-language models: the vision tower's features take the place of the image
tokens' embeddings, and the language model reads the fused sequence with multimodal rotary
positions (``temper.models.layers.mrope_positions``)."""

from __future__ import annotations

import torch
from torch import nn

from temper.data.batch import SequenceShard
from temper.data.mrope_positions import mrope_positions
from temper.kernels.dispatch import Kernels
from temper.models.layers.vision import VisionTower
from temper.models.layers.whole_sequence import local_part
from temper.models.qwen3_5.model import Qwen3_5Transformer
from temper.models.qwen3_5_moe.model import Qwen3_5MoeTransformer
from temper.models.qwen3_5_vl.args import Qwen3_5MoeVLArgs, Qwen3_5VLArgs


class VisionLanguage(nn.Module):
    """Adds ``visual`` (the tower) to a Qwen3.5 decoder, whose ``forward`` and
    ``hidden_states`` then take the images' ``pixel_values`` and ``image_grid_thw`` (as
    transformers' processor gives them) and, optionally, ``rope_position_ids`` [3, b, s]
    (computed from the grids when absent) as keywords, read by ``embed_inputs``. Under
    sequence or context parallelism ``fusion_input_ids`` holds the whole sequence's ids: the
    images are fused into the whole sequence, of which the rank then keeps its tokens."""

    args: Qwen3_5VLArgs
    tok_embeddings: nn.Embedding
    output: nn.Linear
    kernels: Kernels

    def __init__(self, args: Qwen3_5VLArgs) -> None:
        super().__init__(args)
        self.visual = VisionTower(args.vision)

    def init_weights(self) -> None:
        super().init_weights()
        self.visual.init_weights()

    def embed(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
    ) -> torch.Tensor:
        """Token embeddings [b, s, dim] with each image token's row replaced, in order, by
        the tower's features."""
        h = self.tok_embeddings(input_ids)
        if pixel_values is None:
            return h
        features = self.visual(pixel_values, image_grid_thw, self.kernels)
        is_image = input_ids == self.args.image_token_id
        n_tokens = int(is_image.sum())
        if n_tokens != features.shape[0]:
            raise ValueError(
                f"{n_tokens} image tokens for {features.shape[0]} image features "
                f"(grids {image_grid_thw.tolist()})"
            )
        return h.masked_scatter(is_image[..., None], features.to(h.dtype))

    def embed_inputs(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        shard: SequenceShard | None,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        rope_position_ids: torch.Tensor | None = None,
        fusion_input_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder's hook: the fused embeddings of this forward's tokens (a rank's part of
        the whole sequence's under sequence or context parallelism) and their multimodal positions
        (computed from the grids when a batch with images does not bring them)."""
        if pixel_values is not None and rope_position_ids is None:
            if shard is not None:
                raise ValueError("a sequence-parallel slice needs its rope_position_ids")
            merge = self.args.vision.spatial_merge_size
            rope_position_ids = mrope_positions(
                input_ids, image_grid_thw, self.args.image_token_id, merge, position_ids
            )
        if shard is None or pixel_values is None:
            return self.embed(input_ids, pixel_values, image_grid_thw), rope_position_ids
        if fusion_input_ids is None:
            raise ValueError("a sequence-parallel slice with images needs fusion_input_ids")
        embeddings = self.embed(fusion_input_ids, pixel_values, image_grid_thw)
        return local_part(embeddings, shard), rope_position_ids


class Qwen3_5VLTransformer(VisionLanguage, Qwen3_5Transformer):
    """Qwen3.5 (dense) with its vision tower: ``Qwen3_5ForConditionalGeneration``."""

    args: Qwen3_5VLArgs


class Qwen3_5MoeVLTransformer(VisionLanguage, Qwen3_5MoeTransformer):
    """Qwen3.5-MoE with its vision tower: ``Qwen3_5MoeForConditionalGeneration``."""

    args: Qwen3_5MoeVLArgs
