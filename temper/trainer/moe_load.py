"""How a mixture-of-experts model routes its tokens, layer by layer: tokens per expert,
router entropy and imbalance over the steps between log steps, and a layer x expert heatmap
that shows collapse or imbalance at a glance."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

from temper.models.layers.moe import moe_layers
from temper.models.protocols import RoutedModel
from temper.parallel.collectives import all_reduce_sum


class MoELoad:
    """Counts of the routed layers of ``model``, summed over the micro-batches (``add`` after
    each forward, from the model's ``routing``) and, at ``summary``, over the ranks: the
    global batch's routing.

    The counts stay on the device until ``summary``, the one host sync of a log step.
    """

    def __init__(self, model: nn.Module) -> None:
        self.names = list(moe_layers(model))
        self.model = model if isinstance(model, RoutedModel) else None
        self._counts: torch.Tensor | None = None
        self._entropy: torch.Tensor | None = None
        self._tokens: torch.Tensor | None = None

    def __bool__(self) -> bool:
        return bool(self.names) and self.model is not None

    def add(self) -> None:
        """Fold in the routing of each layer in the latest forward."""
        if not self:
            return
        stats = self.model.routing()
        if len(stats) != len(self.names) or any(s.entropy_sum is None for s in stats):
            raise RuntimeError("MoELoad.add before a forward of every MoE layer")
        counts = torch.stack([s.tokens_per_expert for s in stats])
        entropy = torch.stack([s.entropy_sum for s in stats])
        tokens = torch.tensor([float(s.n_tokens) for s in stats], device=entropy.device)
        if self._counts is None:
            self._counts, self._entropy, self._tokens = counts, entropy, tokens
        else:
            self._counts = self._counts + counts
            self._entropy = self._entropy + entropy
            self._tokens = self._tokens + tokens

    def summary(self) -> tuple[dict[str, float], np.ndarray | None]:
        """Metrics per layer (``moe_imbalance/<i>``: busiest expert over the mean;
        ``moe_entropy/<i>``: mean router entropy over log(E), 1 = uniform) and their means,
        with the [layers, experts] token counts; all over every rank since the last call.
        Every rank must call it (a collective)."""
        if self._counts is None:
            return {}, None
        counts = all_reduce_sum(self._counts.double()).cpu().numpy()
        pooled = all_reduce_sum(torch.stack([self._entropy, self._tokens]).double()).cpu()
        entropy = (pooled[0] / pooled[1].clamp(min=1)).numpy()
        self._counts = self._entropy = self._tokens = None
        n_experts = counts.shape[1]
        imbalance = counts.max(axis=1) / np.maximum(counts.mean(axis=1), 1e-12)
        entropy = entropy / math.log(n_experts)
        metrics: dict[str, float] = {}
        for name, imb, ent in zip(self.layer_ids(), imbalance, entropy, strict=True):
            metrics[f"moe_imbalance/{name}"] = float(imb)
            metrics[f"moe_entropy/{name}"] = float(ent)
        metrics["moe_imbalance_mean"] = float(imbalance.mean())
        metrics["moe_entropy_mean"] = float(entropy.mean())
        return metrics, counts

    def layer_ids(self) -> list[str]:
        """Each routed layer's block index (``layers.3.feed_forward`` -> ``3``)."""
        return [name.split(".")[1] if name.startswith("layers.") else name for name in self.names]


def write_load(folder: Path, step: int, layers: list[str], counts: np.ndarray) -> np.ndarray:
    """``<folder>/step-<step>.png`` (the heatmap) and a row of ``<folder>/load.jsonl`` (the
    counts); returns the heatmap."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    image = load_heatmap(counts)
    Image.fromarray(image).save(folder / f"step-{step}.png")
    row = {"step": step, "layers": layers, "tokens_per_expert": counts.astype(int).tolist()}
    with (folder / "load.jsonl").open("a") as handle:
        handle.write(json.dumps(row) + "\n")
    return image


HEATMAP_RANGE = 4.0
"""The colour scale's ends: a load of 1/4 of the layer's mean or less is full blue, 4x or
more full red; the mean is white."""


def load_heatmap(counts: np.ndarray, cell: int | None = None) -> np.ndarray:
    """[layers, experts] counts -> an RGB image [layers * cell, experts * cell, 3] uint8: one
    row per layer, one column per expert, coloured by the expert's load over its layer's mean
    on a log scale (white balanced, red busy, blue idle; an unused expert is black)."""
    layers, experts = counts.shape
    if cell is None:
        cell = max(2, min(32, 1024 // experts))
    ratio = counts / np.maximum(counts.mean(axis=1, keepdims=True), 1e-12)
    scale = np.log(np.maximum(ratio, 1e-12)) / math.log(HEATMAP_RANGE)
    t = np.clip(scale, -1.0, 1.0)[..., None]
    white, red, blue = (
        np.array(c, dtype=np.float64) for c in ((255, 255, 255), (200, 0, 0), (0, 60, 200))
    )
    rgb = np.where(t >= 0, white + t * (red - white), white - t * (blue - white))
    rgb[counts == 0] = 0
    image = rgb.round().astype(np.uint8)
    return image.repeat(cell, axis=0).repeat(cell, axis=1)
