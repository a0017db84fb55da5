"""Router replay: a replayed MoE forward against one computed by hand with those routes, the
rollout's recorded routes against the sampling forwards' own, ties that flip between the
sampler's and the trainer's forwards, the activation-checkpoint recomputation, the
checkpointed rollout buffer and the config's refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from temper.config import ConfigError
from temper.data.batch import IGNORE_INDEX
from temper.data.chat import BUILTIN_TEMPLATE, stop_token_ids
from temper.data.prompts import prompt_dataset
from temper.data.tokenizer import load_tokenizer
from temper.models.layers.clamped_moe import BiasedTopKRouter
from temper.models.layers.context import ForwardContext
from temper.models.layers.moe import MoE
from temper.models.layers.route_replay import (
    ROUTES,
    recording_routes,
    replaying_routes,
    routed_layers,
    stacked,
)
from temper.models.layers.routers import GroupLimitedRouter, GroupLimitedRouting, TopKRouter
from temper.models.registry import build_model
from temper.objectives import GRPO, GRPOConfig
from temper.objectives.causal_lm import label_log_probs
from temper.objectives.dynamic_sampling import fill_rollout
from temper.parallel.activation_checkpoint import apply_activation_checkpointing
from temper.parallel.ulysses import shard_batch
from temper.recipes.posttrain import grpo_debug
from temper.trainer.rollout_buffer import restore_rollout, rollout_state

TINY_MOE = {
    "dim": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "head_dim": 16,
    "ffn_hidden_dim": 128,
    "moe_hidden_dim": 64,
    "mlp_only_layers": (),
}
"""Qwen3-MoE debug shrunk: two MoE layers of 8 experts, top 2."""

NEAR_TIE = 3e-7
"""Relative gap between two experts' router rows: their logits differ at rounding level."""


def tie_experts(model: torch.nn.Module, gap: float = NEAR_TIE) -> None:
    """Every MoE router: expert 0 scores twice expert 1, expert 2 scores expert 1's logit times
    (1 + ``gap``), the rest its negative. Wherever expert 1's logit is positive, experts 1 and
    2 tie for the second slot up to rounding, so forwards that round differently (a decode
    step on a KV cache, a full-sequence forward) can pick different ones."""
    with torch.no_grad():
        for moe in routed_layers(model):
            w = moe.router.gate.weight
            v = w[1].clone()
            w[0], w[2], w[3:] = 2 * v, v * (1 + gap), -v


def fed_positions(labels: torch.Tensor) -> torch.Tensor:
    """[b, w] the rollout row's real input tokens (the prompt and the completion but its last
    token), which the sampler's forwards fed to the model."""
    labelled = labels != IGNORE_INDEX
    ends = (labelled * torch.arange(1, labels.shape[1] + 1)).max(dim=1).values
    return torch.arange(labels.shape[1]) < ends[:, None]


def _objective(**fields: Any) -> GRPO:
    tokenizer = load_tokenizer(None)
    settings = dict(group_size=4, max_new_tokens=8, router_replay=True)
    return GRPO(
        GRPOConfig(**(settings | fields)),
        tokenizer=tokenizer,
        stop_tokens=stop_token_ids(tokenizer, BUILTIN_TEMPLATE),
    )


def _prompts() -> dict[str, torch.Tensor]:
    tokenizer = load_tokenizer(None)
    records = [
        ([{"role": "user", "content": "sort: 3 1 2"}], {"answer": "1 2 3"}),
        ([{"role": "user", "content": "copy: a b"}], {"answer": "a b"}),
    ]
    rows = iter(prompt_dataset(records, tokenizer, BUILTIN_TEMPLATE, width=20))
    batch = [next(rows) for _ in range(2)]
    return {key: torch.stack([row[key] for row in batch]) for key in batch[0]}


def _model(tie: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model("qwen3_moe", "debug", device="cpu", overrides=TINY_MOE)
    if tie:
        tie_experts(model)
    return model


def _free_routes(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The routes the trainer's full-sequence forward picks on its own."""
    with torch.no_grad(), recording_routes(model) as record:
        label_log_probs(model, batch["input_ids"], batch["labels"])
    return stacked(record).to(batch[ROUTES].dtype)


def test_replayed_moe_forward_is_the_hand_routed_forward() -> None:
    """Given routes (not the router's choice), the layer's output, its routing statistics and
    the router's gradient are those of the SwiGLU experts mixed by hand with the router's
    renormalized probabilities at those experts."""
    torch.manual_seed(0)
    dim, hidden, n_experts, k = 16, 24, 4, 2
    moe = MoE(dim, hidden, n_experts, k, norm_topk_prob=True).double()
    moe.init_weights(0.1, 0.1)
    x = torch.randn(2, 5, dim, dtype=torch.float64)
    routes = torch.stack([torch.randperm(n_experts)[:k] for _ in range(10)]).view(2, 5, k)
    cos = sin = torch.zeros(2, 5, 1)
    ctx = ForwardContext(cos, sin, route=routes.to(torch.int16), record_routes=True)
    out, stats = moe(x, ctx)
    assert torch.equal(stats.experts, routes)  # what the experts ran is what was replayed

    tokens = x.reshape(10, dim)
    gate = moe.router.gate.weight.detach().clone().requires_grad_()
    probs = (tokens @ gate.T).softmax(dim=-1, dtype=torch.float32)  # the router's fp32
    weights = probs.gather(1, routes.view(10, k))
    weights = (weights / weights.sum(dim=-1, keepdim=True)).double()
    e = moe.experts
    want = torch.zeros_like(tokens)
    for t in range(10):
        for slot, expert in enumerate(routes.view(10, k)[t].tolist()):
            h = F.silu(e.w1[expert] @ tokens[t]) * (e.w3[expert] @ tokens[t])
            want[t] += weights[t, slot] * (e.w2[expert] @ h)
    torch.testing.assert_close(out.view(10, dim), want, rtol=1e-10, atol=1e-12)
    counts = routes.flatten().bincount(minlength=n_experts)
    assert torch.equal(stats.tokens_per_expert, counts)
    torch.testing.assert_close(stats.prob_sum, probs.sum(0), rtol=1e-6, atol=0)

    out.square().sum().backward()
    want.square().sum().backward()
    assert gate.grad.abs().sum() > 0
    torch.testing.assert_close(moe.router.gate.weight.grad, gate.grad, rtol=1e-6, atol=1e-10)


@pytest.mark.parametrize("router", ["topk", "group_limited", "biased"])
def test_replaying_a_routers_own_choice_changes_nothing(router: str) -> None:
    torch.manual_seed(0)
    dim, n_experts, k = 16, 8, 2
    build = {
        "topk": lambda: TopKRouter(dim, n_experts, k, norm_topk_prob=True),
        "group_limited": lambda: GroupLimitedRouter(
            dim, n_experts, k, True, GroupLimitedRouting(4, 2, 2.5)
        ),
        "biased": lambda: BiasedTopKRouter(dim, n_experts, k),
    }[router]
    module = build()
    module.init_weights(0.5)
    x = torch.randn(12, dim)
    probs, weights, experts = module(x)
    replayed = module(x, experts)
    for got, want in zip(replayed, (probs, weights, experts), strict=True):
        assert torch.equal(got, want)


def test_rollout_records_the_sampling_routes_and_training_replays_them() -> None:
    """Without ties the trainer's forward routes every fed token as the sampler's prefill and
    decode steps did (the record is aligned with the rows); with two experts tied, some token
    flips between them, and under replay the training forward routes every token as recorded
    and its log-probabilities are the old ones (recomputed, as for several updates per
    rollout) to the bit."""
    plain = _model(tie=False)
    batch, _ = _objective().prepare(plain, _prompts(), torch.Generator().manual_seed(0))
    fed = fed_positions(batch["labels"])
    routes = batch[ROUTES]
    assert routes.shape == (*batch["input_ids"].shape, 2, 2)
    assert torch.equal(_free_routes(plain, batch)[fed], routes[fed])
    assert torch.equal(routes[~fed], torch.tensor([0, 1]).expand_as(routes[~fed]).to(routes))

    tied = _model(tie=True)
    objective = _objective(updates_per_rollout=2)
    batch, _ = objective.prepare(tied, _prompts(), torch.Generator().manual_seed(0))
    fed = fed_positions(batch["labels"])
    flipped = (_free_routes(tied, batch) != batch[ROUTES]).any(-1).any(-1) & fed
    assert flipped.sum() > 0  # the setup's point: without replay some token would re-route
    with replaying_routes(tied, batch[ROUTES]), recording_routes(tied) as record:
        log_probs = label_log_probs(tied, batch["input_ids"], batch["labels"])
    assert torch.equal(stacked(record).to(torch.int16), batch[ROUTES])
    completion = batch["labels"] != IGNORE_INDEX
    ratio = torch.exp(log_probs.detach() - batch["old_log_probs"])[completion]
    assert torch.equal(ratio, torch.ones_like(ratio))


def test_activation_checkpoint_recomputation_replays_the_routes() -> None:
    """Under full activation checkpointing the backward recomputes each block with its
    forward's context, so it replays the routes that the loss's forward imposed (nothing is
    around the backward), and the gradients are those of the uncheckpointed replayed step.
    (When the routes were set on the layers, this recomputation re-routed the flipped tokens
    and torch's checkpoint refused it.)"""
    model = _model(tie=True)
    objective = _objective()
    batch, _ = objective.prepare(model, _prompts(), torch.Generator().manual_seed(0))
    batch["advantages"] = torch.linspace(-1.0, 1.0, batch["advantages"].numel())

    def grads() -> list[torch.Tensor]:
        model.zero_grad()
        objective.loss(model, batch)[0].backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    want = grads()
    apply_activation_checkpointing(model.layers, "full")
    for got, ref in zip(grads(), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-9)


def test_routes_travel_with_the_rows_through_sp_slicing_and_dynamic_sampling() -> None:
    """A [b, s, layers, k] field is padded and sliced along s as the tokens are: by
    ``shard_batch`` (SP) and by dynamic sampling's join of rollouts of different widths."""
    routes = torch.arange(2 * 5 * 3 * 2, dtype=torch.int16).view(2, 5, 3, 2)
    ids = torch.arange(10).view(2, 5)
    batch = {"input_ids": ids, "labels": ids.clone(), ROUTES: routes}
    shards = [shard_batch(batch, rank, 2) for rank in range(2)]
    assert torch.equal(torch.cat([s[ROUTES] for s in shards], dim=1)[:, :5], routes)
    assert not shards[1][ROUTES][:, -1].any()  # the padding position

    def sample(prompts: dict, generator: torch.Generator) -> tuple[dict, dict[str, float]]:
        """Two groups of 2 rows ``width`` wide; only the first has signal."""
        width = int(prompts["prompt_ids"][0, 0])
        ids = torch.arange(4 * width).view(4, width)
        advantages = torch.tensor([1.0, -1.0, 0.0, 0.0])
        wide = torch.cat([routes, routes])[:, :width] + width
        return {"input_ids": ids, "labels": ids.clone(), "advantages": advantages, ROUTES: wide}, {}

    prompts = [{"prompt_ids": torch.full((2, 1), w)} for w in (3, 5)]
    draws = iter(prompts[1:])
    joined, _ = fill_rollout(
        sample, prompts[0], lambda: next(draws), lambda d: torch.Generator(), 2, 2
    )
    assert joined[ROUTES].shape == (4, 5, 3, 2)
    assert torch.equal(joined[ROUTES][:2, :3], routes[:, :3] + 3)
    assert not joined[ROUTES][:2, 3:].any()
    assert torch.equal(joined[ROUTES][2:], routes + 5)


def test_routes_survive_a_checkpoint_of_the_rollout_buffer(tmp_path: Path) -> None:
    """The rollout buffer's state saved with DCP and loaded into the template the objective
    builds for this model gives the routes back, at their own width (a rollout that several
    updates train on: the only kind a checkpoint holds)."""
    model = _model(tie=False)
    objective = _objective(updates_per_rollout=2)
    batch, _ = objective.prepare(model, _prompts(), torch.Generator().manual_seed(0))
    width = 32
    dcp.save(
        {"rollout": rollout_state([batch], {"reward_mean": 0.5}, width)}, checkpoint_id=tmp_path
    )
    template = {"rollout": rollout_state([objective.empty_rollout(model, 2, width)], None, width)}
    template["rollout"]["metrics"] = {"reward_mean": 0.0}
    dcp.load(template, checkpoint_id=tmp_path)
    (restored,), _ = restore_rollout(template["rollout"])
    assert restored[ROUTES].dtype == torch.int16
    for key, value in batch.items():
        assert torch.equal(restored[key], value), key


def test_router_replay_is_refused_without_routed_experts_or_with_compiled_decoding() -> None:
    config = grpo_debug()
    config.objective.router_replay = True
    config.model.name = "llama3"
    with pytest.raises(ConfigError, match="objective.router_replay needs a mixture-of-experts"):
        config.objective.validate(config)
    config.model.name = "qwen3_moe"
    config.objective.validate(config)
    config.objective.compile_rollouts = True
    with pytest.raises(ConfigError, match="objective.compile_rollouts"):
        config.objective.validate(config)
