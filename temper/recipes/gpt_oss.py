"""gpt-oss recipes: plain functions returning a Config; derive by calling and editing.

The released sizes start from random weights unless `--model.hf_path` names a local HF folder
(gpt-oss-20b, gpt-oss-120b as published: MXFP4 experts, dequantized on load), whose config.json
then sets the architecture.
"""

from __future__ import annotations

from temper.config import ActivationCheckpoint, Config, Model
from temper.recipes.shapes import debug_pretrain, gpu_sft


def gpt_oss_debug() -> Config:
    """An 8M-parameter gpt-oss (4 layers alternating a 16-token window and full attention,
    sinks, 8 biased experts, top 2) on the built-in synthetic tasks; trains on a CPU."""
    return debug_pretrain(Model(name="gpt_oss", flavor="debug"))


def gpt_oss_20b_sft() -> Config:
    """Chat SFT of gpt-oss-20b in bf16 at 4096 tokens, 64 sequences per optimizer step, with
    its 32 experts split over 8 expert-parallel ranks (4 each) and FSDP over the rest.

    Point it at the released folder: `NGPU=8 MODULE=temper.recipes.gpt_oss
    CONFIG=gpt_oss_20b_sft ./run_train.sh --model.hf_path /models/gpt-oss-20b
    --data.path chats.jsonl`. The ~21B parameters (42 GB in bf16) plus fp32 masters and AdamW
    state need the 8 GPUs' memory together."""
    return gpu_sft(
        "gpt_oss_20b_sft",
        Model(name="gpt_oss", flavor="20b"),
        ep=8,
        global_batch_size=64,
        checkpoint=ActivationCheckpoint(),
    )
