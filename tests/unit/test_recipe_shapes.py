"""The recipes built on the shared run shapes (``temper.recipes.shapes``) give the Configs they
spelled out in full before: one recipe per shape, compared with its former literal."""

from __future__ import annotations

from temper.config import (
    ActivationCheckpoint,
    Config,
    Data,
    Job,
    LRScheduler,
    Model,
    Optimizer,
    Parallelism,
    Training,
)
from temper.recipes.deepseek_v32 import deepseek_v32_debug
from temper.recipes.gpt_oss import gpt_oss_20b_sft
from temper.recipes.posttrain import sft_debug
from temper.recipes.qwen3 import qwen3_8b
from temper.recipes.qwen3_5 import qwen3_5_35b_a3b_sft


def _gpu_training(global_batch_size: int) -> Training:
    return Training(
        steps=1000,
        seq_len=4096,
        local_batch_size=1,
        global_batch_size=global_batch_size,
        dtype="bfloat16",
        max_norm=1.0,
    )


def test_recipes_keep_their_configs() -> None:
    assert deepseek_v32_debug() == Config(
        job=Job(dump_folder="./outputs/deepseek_v32_debug"),
        model=Model(name="deepseek_v32", flavor="debug", indexer_training="sparse"),
        training=Training(steps=60, seq_len=256, local_batch_size=8, max_norm=1.0),
        optimizer=Optimizer(lr=2e-3, weight_decay=0.1),
        lr_scheduler=LRScheduler(warmup_steps=5, decay="cosine", min_lr_ratio=0.1),
    )
    assert sft_debug() == Config(
        job=Job(dump_folder="./outputs/sft_debug"),
        model=Model(name="llama3", flavor="debug"),
        training=Training(steps=60, seq_len=64, local_batch_size=8),
        optimizer=Optimizer(lr=2e-3, weight_decay=0.0),
        lr_scheduler=LRScheduler(warmup_steps=10, decay="cosine", min_lr_ratio=0.1),
        data=Data(format="sft"),
    )
    assert qwen3_8b() == Config(
        job=Job(dump_folder="./outputs/qwen3_8b"),
        model=Model(name="qwen3", flavor="8b"),
        training=_gpu_training(128),
        optimizer=Optimizer(lr=1e-5, weight_decay=0.1),
        lr_scheduler=LRScheduler(warmup_steps=50, decay="cosine", min_lr_ratio=0.1),
    )
    sft = {
        "optimizer": Optimizer(lr=1e-5, weight_decay=0.0),
        "lr_scheduler": LRScheduler(warmup_steps=30, decay="cosine", min_lr_ratio=0.1),
        "data": Data(format="sft"),
    }
    assert qwen3_5_35b_a3b_sft() == Config(
        job=Job(dump_folder="./outputs/qwen3_5_35b_a3b_sft"),
        model=Model(name="qwen3_5_moe", flavor="35b_a3b"),
        parallelism=Parallelism(ep=8),
        activation_checkpoint=ActivationCheckpoint(mode="full"),
        training=_gpu_training(64),
        **sft,
    )
    assert gpt_oss_20b_sft() == Config(
        job=Job(dump_folder="./outputs/gpt_oss_20b_sft"),
        model=Model(name="gpt_oss", flavor="20b"),
        parallelism=Parallelism(ep=8),
        training=_gpu_training(64),
        **sft,
    )
