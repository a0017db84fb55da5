"""Vision-language recipes: image SFT of the Qwen3.5 VLM families, and a held-out score.

    MODULE=temper.recipes.vision CONFIG=qwen3_5_vl_debug ./run_train.sh
    python -m temper.recipes.vision qwen3_5_vl_debug    # train, held-out accuracy before/after

The debug recipe trains a random-init Qwen3.5 VLM (tower included) on the built-in shapes
task (``temper.data.shapes``). It is scored by choice: of the answers a question allows
(three shapes, four colours), the one the model gives the highest log-probability must be the
right one; guessing scores about 0.29.
"""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING

import torch

from temper.config import Config, Data, Model
from temper.data.multimodal import (
    BUILTIN_VL_TEMPLATE,
    builtin_image_processor,
    collate,
    image_row,
    image_samples,
)
from temper.data.sft import pad_id
from temper.data.shapes import shape_conversation, shape_example
from temper.data.vision_tokens import vision_token_ids
from temper.kernels.cross_entropy import log_probs_from_logits
from temper.recipes.shapes import debug_sft

if TYPE_CHECKING:
    from temper.trainer.trainer import Trainer

EVAL_EXAMPLES = 64


def qwen3_5_vl_debug() -> Config:
    """Image SFT of a random-init debug Qwen3.5 VLM on the built-in shapes task (CPU, minutes)."""
    return debug_sft(
        "qwen3_5_vl_debug",
        Model(name="qwen3_5_vl", flavor="debug"),
        Data(format="sft", builtin_images=True),
    )


def qwen3_5_moe_vl_debug() -> Config:
    """The same with a Qwen3.5-MoE language model (8 experts, top 2)."""
    config = qwen3_5_vl_debug()
    config.job.dump_folder = "./outputs/qwen3_5_moe_vl_debug"
    config.model = Model(name="qwen3_5_moe_vl", flavor="debug")
    return config


@torch.no_grad()
def shape_accuracy(trainer: Trainer, count: int = EVAL_EXAMPLES) -> dict[str, float]:
    """Held-out accuracy of the model's choice among each question's answers."""
    engine, config = trainer.engine, trainer.config
    tokenizer, processor = engine.tokenizer, builtin_image_processor()
    build = functools.partial(
        image_row,
        seq_len=config.training.seq_len,
        fill=pad_id(tokenizer),
        pack=False,
        processor=processor,
        image_token_id=vision_token_ids(tokenizer).image,
    )
    engine.model.eval()
    right = 0
    for i in range(count):
        facts, question, choices = shape_example(config.training.seed, "eval", i)
        records = [
            (f"eval {i}", shape_conversation(question, c), [facts["image"]]) for c in choices
        ]
        samples = image_samples(records, tokenizer, BUILTIN_VL_TEMPLATE, processor)
        rows = [build([sample]) for sample in samples]
        batch = {k: v.to(engine.device) for k, v in collate(rows).items()}
        media = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "rope_position_ids")}
        log_probs, _ = log_probs_from_logits(
            engine.model(batch["input_ids"], **media), batch["labels"]
        )
        best = choices[int(log_probs.sum(-1).argmax())]
        right += best == facts["answer"]
    engine.model.train()
    return {"accuracy": right / count}


def main(argv: list[str]) -> None:
    """Train a recipe of this module with the held-out accuracy before and after."""
    from temper.config import load_config
    from temper.trainer.trainer import Trainer

    trainer = Trainer(load_config("temper.recipes.vision", argv[0], argv[1:]))
    before = shape_accuracy(trainer)
    trainer.train()
    after = shape_accuracy(trainer)
    print(f"held-out shape_accuracy: before {before}, after {after}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
