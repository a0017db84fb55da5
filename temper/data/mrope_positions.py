"""Multimodal rotary positions (Qwen3-VL, Qwen3.5): (time, height, width) per token.

Text tokens count up on all three axes alike. An image's tokens (one per merge block of its
patch grid ``(t, h, w)``) sit on a grid that starts where the text left off: time, row and
column each offset by that start; the text after the image resumes at the start plus the
larger of the image's merged height and width. Packed rows restart at each document, as
their text positions do.
"""

from __future__ import annotations

import torch


def document_mrope_positions(
    input_ids: torch.Tensor, grids: torch.Tensor, image_token_id: int, merge: int
) -> torch.Tensor:
    """Positions [3, s] of one document's tokens [s]; ``grids`` [n, 3] are its images' patch
    grids in order, whose merged sizes must add up to its image tokens."""
    is_image = (input_ids == image_token_id).tolist()
    parts, pos, i, image = [], 0, 0, 0
    while i < len(is_image):
        if not is_image[i]:
            end = i
            while end < len(is_image) and not is_image[end]:
                end += 1
            parts.append(torch.arange(pos, pos + end - i).expand(3, -1))
            pos, i = pos + end - i, end
            continue
        if image >= len(grids):
            raise ValueError(f"more image tokens than the {len(grids)} image grids describe")
        t, h, w = (int(x) for x in grids[image])
        h, w = h // merge, w // merge
        axes = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        parts.append(torch.stack(axes).flatten(1) + pos)
        pos, i, image = pos + max(h, w), i + t * h * w, image + 1
    if image != len(grids):
        raise ValueError(f"{len(grids)} image grids for {image} images' tokens")
    return torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)


def mrope_positions(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor,
    image_token_id: int,
    merge: int,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Positions [3, b, s] of a batch [b, s] whose images' grids ``image_grid_thw`` [n, 3] are
    listed row by row, in order; ``position_ids`` (packed rows) restart at 0 where each
    document starts."""
    out = torch.zeros(3, *input_ids.shape, dtype=torch.long)
    sizes = (image_grid_thw.prod(-1) // merge**2).tolist()
    image = 0
    for row, ids in enumerate(input_ids.cpu()):
        starts = [0]
        if position_ids is not None:
            starts = (position_ids[row].cpu() == 0).nonzero().flatten().tolist() or [0]
            if starts[0] != 0:
                starts = [0, *starts]
        for begin, end in zip(starts, [*starts[1:], len(ids)], strict=True):
            doc = ids[begin:end]
            n_tokens = int((doc == image_token_id).sum())
            first = image
            while n_tokens > 0 and image < len(sizes):
                n_tokens -= sizes[image]
                image += 1
            grids = image_grid_thw[first:image].cpu()
            out[:, row, begin:end] = document_mrope_positions(doc, grids, image_token_id, merge)
    if image != len(sizes):
        raise ValueError(f"{len(sizes)} image grids for {image} images' tokens in the batch")
    return out.to(input_ids.device)
