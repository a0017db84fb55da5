"""gpt-oss recipes: plain functions returning a Config; derive by calling and editing.

The released sizes start from random weights unless `--model.hf_path` names a local HF folder
(gpt-oss-20b, gpt-oss-120b as published: MXFP4 experts, dequantized on load), whose config.json
then sets the architecture.
"""

from __future__ import annotations

from temper.config import Config, Data, Job, LRScheduler, Model, Optimizer, Parallelism, Training


def gpt_oss_debug() -> Config:
    """An 8M-parameter gpt-oss (4 layers alternating a 16-token window and full attention,
    sinks, 8 biased experts, top 2) on the built-in synthetic tasks; trains on a CPU."""
    return Config(
        job=Job(dump_folder="./outputs/gpt_oss_debug"),
        model=Model(name="gpt_oss", flavor="debug"),
        training=Training(steps=60, seq_len=256, local_batch_size=8, max_norm=1.0),
        optimizer=Optimizer(lr=2e-3, weight_decay=0.1),
        lr_scheduler=LRScheduler(warmup_steps=5, decay="cosine", min_lr_ratio=0.1),
    )


def gpt_oss_20b_sft() -> Config:
    """Chat SFT of gpt-oss-20b in bf16 at 4096 tokens, 64 sequences per optimizer step, with
    its 32 experts split over 8 expert-parallel ranks (4 each) and FSDP over the rest.

    Point it at the released folder: `NGPU=8 MODULE=temper.recipes.gpt_oss
    CONFIG=gpt_oss_20b_sft ./run_train.sh --model.hf_path /models/gpt-oss-20b
    --data.path chats.jsonl`. The ~21B parameters (42 GB in bf16) plus fp32 masters and AdamW
    state need the 8 GPUs' memory together."""
    return Config(
        job=Job(dump_folder="./outputs/gpt_oss_20b_sft"),
        model=Model(name="gpt_oss", flavor="20b"),
        parallelism=Parallelism(ep=8),
        training=Training(
            steps=1000,
            seq_len=4096,
            local_batch_size=1,
            global_batch_size=64,
            dtype="bfloat16",
            max_norm=1.0,
        ),
        optimizer=Optimizer(lr=1e-5, weight_decay=0.0),
        lr_scheduler=LRScheduler(warmup_steps=30, decay="cosine", min_lr_ratio=0.1),
        data=Data(format="sft"),
    )
