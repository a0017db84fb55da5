"""Qwen3.5 vision-language models: the vision tower's features take the place of the image
tokens' embeddings, and the language model reads the fused sequence with multimodal rotary
positions (``temper.models.layers.mrope_positions``)."""

from __future__ import annotations

import torch
from torch import nn

from temper.data.batch import SequenceShard
from temper.data.mrope_positions import mrope_positions
from temper.kernels.attention import DocumentMask
from temper.models.layers.kv_cache import KVCache
from temper.models.layers.vision import VisionTower
from temper.models.qwen3_5.model import Qwen3_5Transformer
from temper.models.qwen3_5_moe.model import Qwen3_5MoeTransformer
from temper.models.qwen3_5_vl.args import Qwen3_5MoeVLArgs, Qwen3_5VLArgs


class VisionLanguage(nn.Module):
    """Adds ``visual`` (the tower) to a Qwen3.5 decoder; ``forward`` and ``hidden_states``
    take the images' ``pixel_values`` and ``image_grid_thw`` (as transformers' processor gives
    them) and, optionally, ``rope_position_ids`` [3, b, s] (computed from the grids when
    absent). Under sequence parallelism ``fusion_input_ids`` holds the whole sequence's ids:
    the images are fused into the whole sequence, which is then sliced as the tokens were."""

    args: Qwen3_5VLArgs
    tok_embeddings: nn.Embedding
    output: nn.Linear

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
        features = self.visual(pixel_values, image_grid_thw)
        is_image = input_ids == self.args.image_token_id
        n_tokens = int(is_image.sum())
        if n_tokens != features.shape[0]:
            raise ValueError(
                f"{n_tokens} image tokens for {features.shape[0]} image features "
                f"(grids {image_grid_thw.tolist()})"
            )
        return h.masked_scatter(is_image[..., None], features.to(h.dtype))

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        docs: DocumentMask | None = None,
        cache: KVCache | None = None,
        shard: SequenceShard | None = None,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        rope_position_ids: torch.Tensor | None = None,
        fusion_input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self._fused_hidden_states(
            input_ids,
            position_ids,
            docs,
            cache,
            shard,
            pixel_values,
            image_grid_thw,
            rope_position_ids,
            fusion_input_ids,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        docs: DocumentMask | None = None,
        cache: KVCache | None = None,
        shard: SequenceShard | None = None,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        rope_position_ids: torch.Tensor | None = None,
        fusion_input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [b, s, vocab] (the last position's only with a KV ``cache``)."""
        h = self._fused_hidden_states(
            input_ids,
            position_ids,
            docs,
            cache,
            shard,
            pixel_values,
            image_grid_thw,
            rope_position_ids,
            fusion_input_ids,
        )
        return self.output(h if cache is None else h[:, -1:])

    def _fused_hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        docs: DocumentMask | None,
        cache: KVCache | None,
        shard: SequenceShard | None,
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        rope_position_ids: torch.Tensor | None,
        fusion_input_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        if pixel_values is not None and rope_position_ids is None:
            if shard is not None:
                raise ValueError("a sequence-parallel slice needs its rope_position_ids")
            merge = self.args.vision.spatial_merge_size
            rope_position_ids = mrope_positions(
                input_ids, image_grid_thw, self.args.image_token_id, merge, position_ids
            )
        if shard is None or pixel_values is None:
            embeddings = self.embed(input_ids, pixel_values, image_grid_thw)
        elif fusion_input_ids is None:
            raise ValueError("a sequence-parallel slice with images needs fusion_input_ids")
        else:
            embeddings = self.embed(fusion_input_ids, pixel_values, image_grid_thw)
            embeddings = embeddings[:, shard.start : shard.start + input_ids.shape[1]]
        return self._hidden_states(
            input_ids, position_ids, docs, cache, shard, embeddings, rope_position_ids
        )


class Qwen3_5VLTransformer(VisionLanguage, Qwen3_5Transformer):
    """Qwen3.5 (dense) with its vision tower: ``Qwen3_5ForConditionalGeneration``."""

    args: Qwen3_5VLArgs


class Qwen3_5MoeVLTransformer(VisionLanguage, Qwen3_5MoeTransformer):
    """Qwen3.5-MoE with its vision tower: ``Qwen3_5MoeForConditionalGeneration``."""

    args: Qwen3_5MoeVLArgs
