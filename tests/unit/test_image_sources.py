"""Image SFT on the one data pipeline: an image source mixes with a text chat source under
data.sources, holds out validation records, and its data state, saved by two data-parallel
ranks, resumes in one process exactly where the straight run goes on."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from PIL import Image

from temper.config import Config, DataSource, Training, Validation
from temper.data.loader import build_loader, build_validation_loader
from temper.data.stream import merge_states
from temper.data.tasks import sft_conversations
from temper.data.tokenizer import load_tokenizer

SIZES = [(32, 32), (64, 32), (32, 64), (64, 64), (96, 32), (32, 96), (96, 64), (64, 96)]
"""Width x height of image record i: its grid tells which record a row holds."""


def _image_set(folder: Path) -> None:
    """Eight one-image chats, the pictures relative to the JSONL file."""
    (folder / "img").mkdir()
    lines = []
    for i, (w, h) in enumerate(SIZES):
        Image.new("RGB", (w, h), (30 * i, 200 - 20 * i, 90)).save(folder / "img" / f"{i}.png")
        user = [{"type": "image", "image": f"img/{i}.png"}, {"type": "text", "text": "size?"}]
        messages = [
            {"role": "user", "content": user},
            {"role": "assistant", "content": f"{w} by {h}"},
        ]
        lines.append(json.dumps({"messages": messages}) + "\n")
    (folder / "images.jsonl").write_text("".join(lines))


def _text_set(folder: Path) -> None:
    lines = (json.dumps({"messages": c}) + "\n" for c in sft_conversations(1, "train", 24))
    (folder / "text.jsonl").write_text("".join(lines))


def _config(folder: Path, world: int, *, pack: bool, fraction: float = 0.0) -> Config:
    config = Config(training=Training(seq_len=64, local_batch_size=4 // world, global_batch_size=4))
    config.data.format = "sft"
    config.data.pack = pack
    if not (folder / "images.jsonl").exists():
        _image_set(folder)
        _text_set(folder)
    config.data.sources = [
        DataSource(str(folder / "images.jsonl"), weight=1.0),
        DataSource(str(folder / "text.jsonl"), weight=3.0),
    ]
    config.validation = Validation(interval=1, fraction=fraction, steps=1)
    return config


def _grid(i: int) -> list[int]:
    w, h = SIZES[i]
    return [1, h // 16, w // 16]


def test_an_image_source_mixes_with_a_text_source(tmp_path: Path) -> None:
    config = _config(tmp_path, 1, pack=False, fraction=0.25)
    tokenizer = load_tokenizer(None)
    loader = build_loader(config, tokenizer, 0, 1)
    images = texts = 0
    for _, batch in zip(range(40), loader, strict=False):
        with_image = (batch["input_ids"] == 2047).any(-1)  # rows holding an image token
        grids = batch.get("image_grid_thw", torch.zeros(0, 3)).tolist()  # none: no key
        assert len(grids) == int(with_image.sum())  # one image a row
        for grid in grids:
            assert grid in [_grid(i) for i in range(6)]  # never a held-out record's
        images += int(with_image.sum())
        texts += int((~with_image).sum())
        assert (batch["labels"] != -100).any(-1).all()  # every row trains on an answer
    stats = loader.stats
    assert (stats["images_documents"], stats["text_documents"]) == (images, texts)
    assert images + texts == 160
    assert 25 <= images <= 55  # 1:3 by weight: 40 expected, 3 standard deviations ~ 16

    validation = next(iter(build_validation_loader(config, tokenizer, 0, 1)))
    held = validation["image_grid_thw"].tolist()
    assert held and all(grid in (_grid(6), _grid(7)) for grid in held)


def test_image_data_resumes_at_another_data_parallel_size(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(None)
    straight = iter(build_loader(_config(tmp_path, 1, pack=True), tokenizer, 0, 1))
    expected = [next(straight) for _ in range(4)]

    rank_loaders = [build_loader(_config(tmp_path, 2, pack=True), tokenizer, r, 2) for r in (0, 1)]
    for step in range(2):
        halves = [next(iter(loader)) for loader in rank_loaders]
        # rank 0 holds lanes 0-1 of the step's rows, rank 1 lanes 2-3
        assert torch.equal(torch.cat([h["input_ids"] for h in halves]), expected[step]["input_ids"])
    state = merge_states([loader.state_dict() for loader in rank_loaders])

    resumed = build_loader(_config(tmp_path, 1, pack=True), tokenizer, 0, 1)
    resumed.load_state_dict(state)
    stream = iter(resumed)
    for step in (2, 3):
        got, want = next(stream), expected[step]
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), key
