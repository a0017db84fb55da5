"""Router replay under expert parallelism: with two experts tied in every router, the
trainer's full-sequence forward would route some token otherwise than the sampler's prefill
and decode steps did; with replay each rank's training forward routes every token as
recorded and the first update's importance ratio is exactly 1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import run_on_ranks

from temper.config import Config
from temper.recipes.posttrain import grpo_debug

PROMPTS = [
    [("copy: a b", "a b"), ("sort: 3 1 2", "1 2 3")],
    [("sort: 9 8 7 6 5 4 3 2", "2 3 4 5 6 7 8 9"), ("copy: x", "x")],
]
"""Rank r's prompts: each rank decodes its own rows (in lockstep with the other)."""

NEAR_TIE = 3e-7
"""Relative gap between two experts' router rows: their logits differ at rounding level."""


def _config(folder: Path, sp: int) -> Config:
    config = grpo_debug()
    config.job.dump_folder = str(folder)
    config.model.name = "qwen3_moe"
    config.checkpoint.initial_recipe = None
    config.lora.enable = False
    config.metrics.tensorboard = False
    config.parallelism.ep = 2
    config.parallelism.sp = sp
    config.training.seq_len = 40
    config.training.local_batch_size = 2
    config.training.global_batch_size = 4
    config.objective.group_size = 2
    config.objective.max_new_tokens = 8
    config.objective.router_replay = True
    return config


def _tie_experts(model: torch.nn.Module) -> None:
    """Every router: expert 0 scores twice expert 1, expert 2 expert 1's logit times
    (1 + ``NEAR_TIE``), the rest its negative: where expert 1's logit is positive, experts 1
    and 2 tie for the second slot up to rounding. The gate may be an FSDP2 shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from temper.models.layers.route_replay import routed_layers

    with torch.no_grad():
        for moe in routed_layers(model):
            weight = moe.router.gate.weight
            sharded = isinstance(weight, DTensor)
            full = weight.full_tensor() if sharded else weight.detach().clone()
            v = full[1].clone()
            full[0], full[2], full[3:] = 2 * v, v * (1 + NEAR_TIE), -v
            if sharded:
                full = distribute_tensor(full, weight.device_mesh, weight.placements)
            weight.copy_(full)


def fed_positions(labels: torch.Tensor) -> torch.Tensor:
    """[b, w] the rollout row's real input tokens (the prompt and the completion but its last
    token), which the sampler's forwards fed to the model."""
    labelled = (labels != -100) * torch.arange(1, labels.shape[1] + 1)
    return torch.arange(labels.shape[1]) < labelled.max(dim=1).values[:, None]


def _replay_on_rank(config: Config) -> dict[str, Any]:
    """This rank's rollout with tied experts; the routes its trainer forward picks alone and
    under replay, and the first update's ratio and loss (whose backward runs replayed)."""
    from temper.data.batch import IGNORE_INDEX, SEQUENCE_SHARD, pad_tokens
    from temper.data.chat import BUILTIN_TEMPLATE
    from temper.data.prompts import prompt_dataset
    from temper.engine import Engine
    from temper.models.layers.route_replay import (
        ROUTES,
        recording_routes,
        replaying_routes,
        stacked,
    )
    from temper.objectives import build_objective
    from temper.objectives.causal_lm import documents, label_log_probs

    engine = Engine(config)
    model = engine.model
    _tie_experts(model)
    objective = build_objective(config, engine.build_reference)
    objective.sampler.recompute_old = True  # the old log-probs' forward, replayed
    rank = engine.dims.dp_rank  # the SP ranks of one data rank roll out its prompts alike
    messages = [
        ([{"role": "user", "content": p}], {"prompt": p, "answer": a}) for p, a in PROMPTS[rank]
    ]
    stream = iter(prompt_dataset(messages, engine.tokenizer, BUILTIN_TEMPLATE, width=24))
    rows = [next(stream) for _ in messages]
    prompts = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    with engine.autocast():
        batch, _ = objective.prepare(model, prompts, torch.Generator().manual_seed(rank))
    fed = fed_positions(batch["labels"])
    batch = engine.prepare_batch(batch)
    ids, labels = batch["input_ids"], batch["labels"]
    shard = batch.get(SEQUENCE_SHARD)
    if shard is not None:  # this SP rank's slice of the rows
        fed = pad_tokens(fed, shard.seq_len - fed.shape[1])[:, shard.start :][:, : ids.shape[1]]
    inputs = (ids, labels, batch.get("position_ids"), documents(batch))
    options = {"temperature": objective.loss_temperature, "shard": shard}
    with torch.no_grad(), recording_routes(model) as record:
        label_log_probs(model, *inputs, **options)
    free = stacked(record).to(batch[ROUTES].dtype)
    routes = batch[ROUTES]
    with replaying_routes(model, routes), recording_routes(model) as record, engine.autocast():
        log_probs = label_log_probs(model, *inputs, **options)
    with engine.autocast():
        loss, _, _ = objective.loss(model, batch)
    loss.backward()  # replayed under EP: each rank's all-to-all carries the recorded split
    replayed = stacked(record).to(batch[ROUTES].dtype)
    completion = labels != IGNORE_INDEX
    return {
        "routes": batch[ROUTES],
        "free": free,
        "replayed": replayed,
        "fed": fed,
        "ratio": torch.exp(log_probs.detach() - batch["old_log_probs"])[completion],
        "loss": float(loss.detach()),
    }


@pytest.mark.parametrize("sp", [1, 2], ids=["ep2", "sp2_ep2"])
def test_router_replay_under_expert_parallelism_keeps_tied_tokens_on_their_sampled_experts(
    tmp_path: Path, sp: int
) -> None:
    """Under SP each rank trains a slice of the rows: its training forward routes the slice's
    tokens as recorded; its log-probabilities come from attention over the whole sequence in
    pieces, so the ratio is 1 up to rounding there (1e-5), exactly 1 without SP."""
    ranks = run_on_ranks(_replay_on_rank, 2, _config(tmp_path, sp), timeout=180)
    flips = 0
    for got in ranks:
        fed = got["fed"]
        # Without replay the trainer's forward re-routes some sampled token (the tie bites).
        flips += int(((got["free"] != got["routes"]).any(-1).any(-1) & fed).sum())
        # With replay every token, fed or padding, runs on its recorded experts.
        assert torch.equal(got["replayed"], got["routes"])
        if sp == 1:
            assert torch.equal(got["ratio"], torch.ones_like(got["ratio"]))
        else:
            torch.testing.assert_close(
                got["ratio"], torch.ones_like(got["ratio"]), rtol=0, atol=1e-5
            )
        assert torch.isfinite(torch.tensor(got["loss"]))
    assert flips > 0
    assert sum(got["ratio"].numel() for got in ranks) > 0  # an SP slice may hold none
