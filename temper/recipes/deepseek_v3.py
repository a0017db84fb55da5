"""DeepSeek V3 recipes: plain functions returning a Config; derive by calling and editing.

The real sizes start from random weights unless `--model.hf_path` names a local HF folder
(DeepSeek-V3, Moonlight-16B-A3B, ...), whose config.json then sets the architecture. Load
balancing is DeepSeek's: the per-expert bias moves by `expert_bias_update_rate` after each
optimizer step (the model's `update_expert_bias`), and `router_aux_loss_coef` is 0.
"""

from __future__ import annotations

from temper.config import Config, Model
from temper.recipes.shapes import debug_pretrain, gpu_pretrain


def deepseek_v3_debug() -> Config:
    """A ~7.8M-parameter DeepSeek V3 (MLA, 8 experts in 2 groups, top 2, a shared expert,
    layer 0 dense) on the built-in synthetic tasks; trains on a CPU in about a minute."""
    return debug_pretrain(Model(name="deepseek_v3", flavor="debug"))


def deepseek_v3_debug_mtp() -> Config:
    """The debug model with one multi-token-prediction depth trained jointly (weight 0.3):
    logs ``mtp_loss`` and ``mtp_accuracy``, the draft's next-token accuracy."""
    config = deepseek_v3_debug()
    config.job.dump_folder = "./outputs/deepseek_v3_debug_mtp"
    config.model.mtp_depth = 1
    return config


def deepseek_v3_16b() -> Config:
    """The 16B flavor (Moonlight-16B-A3B's shape: 64 experts, top 6, 2 shared) in bf16 at
    4096 tokens, 128 sequences (0.5M tokens) per optimizer step on GPUs.

    Its ~16B parameters (32 GB in bf16, plus fp32 masters and AdamW state) need FSDP and
    expert parallelism to fit, e.g. `NGPU=8 ./run_train.sh --parallelism.ep 8` on one node."""
    return gpu_pretrain(
        "deepseek_v3_16b", Model(name="deepseek_v3", flavor="16b"), global_batch_size=128
    )


def deepseek_v3_671b() -> Config:
    """DeepSeek-V3 (671B, 256 experts, top 8 in 4 of 8 groups) in bf16 at 4096 tokens, 256
    sequences (1M tokens) per optimizer step on GPUs.

    Needs many nodes with FSDP and expert parallelism (e.g. `NNODES=32 NGPU=8 ...
    --parallelism.ep 64`): the weights alone are 1.3 TB in bf16, 656B of the 671B
    parameters in experts."""
    config = deepseek_v3_16b()
    config.job.dump_folder = "./outputs/deepseek_v3_671b"
    config.model = Model(name="deepseek_v3", flavor="671b")
    config.training.global_batch_size = 256
    return config


def deepseek_v3_671b_mtp() -> Config:
    """DeepSeek-V3 with its multi-token-prediction depth, as trained and released (the hub
    folder holds it as ``model.layers.61``): ``--model.hf_path`` to the local folder keeps it,
    and exports write it back. Weight 0.1, DeepSeek V3's value late in pretraining."""
    config = deepseek_v3_671b()
    config.job.dump_folder = "./outputs/deepseek_v3_671b_mtp"
    config.model.mtp_depth = 1
    config.model.mtp_loss_weight = 0.1
    return config
