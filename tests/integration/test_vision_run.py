"""The image SFT path end to end on one process: the built-in image task trains a debug
Qwen3.5 VLM through the Trainer, its checkpoint exports, and transformers'
`AutoModelForImageTextToText` loads the export with the trained model's logits on an image
prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText

from temper.checkpoint.convert import dcp_to_hf
from temper.config import load_config
from temper.data.multimodal import collate
from temper.trainer.trainer import Trainer

pytestmark = pytest.mark.slow


def test_image_sft_trains_and_exports(tmp_path: Path) -> None:
    flags = ["--training.steps", "4", "--training.seq_len", "48", "--data.builtin_examples", "32"]
    flags += ["--job.dump_folder", str(tmp_path / "run"), "--metrics.no_tensorboard"]
    trainer = Trainer(
        load_config("temper.recipes.vision", "qwen3_5_vl_debug", [*flags, "--checkpoint.enable"])
    )
    trainer.train()
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert rows[-1]["loss"] < rows[0]["loss"]

    checkpoint = next((tmp_path / "run" / "checkpoints").glob("step-*"))
    dcp_to_hf(checkpoint, tmp_path / "hf")
    hf = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf").eval()
    stream = iter(trainer.loader.dataset)
    batch = collate([next(stream), next(stream)])
    image = trainer.engine.model.args.image_token_id
    model = trainer.engine.model.eval()
    with torch.no_grad():
        want = model(
            batch["input_ids"],
            pixel_values=batch["pixel_values"],
            image_grid_thw=batch["image_grid_thw"],
        )
        got = hf(
            input_ids=batch["input_ids"],
            pixel_values=batch["pixel_values"],
            image_grid_thw=batch["image_grid_thw"],
            mm_token_type_ids=(batch["input_ids"] == image).int(),
        ).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
