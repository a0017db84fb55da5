"""GRPO rollouts across ranks against one process: the same rows, log-probabilities and losses
when ranks' rows differ in width (FSDP2) and when ranks stop decoding at different steps
(expert parallelism, whose every forward is an all-to-all)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import run_on_ranks
from training import assert_same_metrics

from temper.config import Config
from temper.objectives import register_reward
from temper.recipes.posttrain import grpo_debug

SHORT = [("copy: a", "a"), ("copy: b", "b")]
LONG = [("sort: 9 8 7 6 5 4 3 2 1 0 9 8 7 6", "x"), ("sort: 5 4 3 2 1 0 9 8 7 6 5 4", "y")]
TIMINGS = (
    "tokens_per_second",
    "computed_tokens_per_second",
    "tflops",
    "mfu",
    "eta_seconds",
    "memory_gib",
    "rollout_seconds",
    "train_seconds",
    "rollout_time_share",
)
MEASURED_PREFIXES = ("time_", "mem_")
"""Clock and memory readings (phase timers, per-phase peaks), which no two runs share."""


@register_reward("test_brevity")
def brevity(prompt: str, completion: str, answer: str) -> float:
    """A reward that a random model earns unevenly once rows stop at random: shorter is better."""
    return 1.0 / (1.0 + len(completion))


def _config(folder: Path, model: str = "llama3") -> Config:
    config = grpo_debug()
    config.job.dump_folder = str(folder)
    config.model.name = model
    config.checkpoint.initial_recipe = None
    config.lora.enable = False
    config.metrics.tensorboard = False
    config.training.seq_len = 56
    config.training.local_batch_size = 1
    config.training.global_batch_size = 2
    config.objective.group_size = 2
    config.objective.max_new_tokens = 12
    return config


def _rollouts_on_rank(config: Config) -> list[dict[str, Any]]:
    """Rank r rolls out prompt set r; one process rolls out both, one after the other."""
    import torch.distributed as dist

    from temper.data.chat import BUILTIN_TEMPLATE
    from temper.data.prompts import prompt_dataset
    from temper.engine import Engine
    from temper.objectives import build_objective

    engine = Engine(config)
    objective = build_objective(config, engine.build_reference)
    objective.sampler.recompute_old = True  # the scoring forward, on rows of unequal widths
    world = dist.get_world_size() if dist.is_initialized() else 1
    sets = [SHORT, LONG] if world == 1 else [[SHORT, LONG][engine.runtime.rank]]
    results = []
    for index, records in enumerate(sets):
        rank = index if world == 1 else engine.runtime.rank
        messages = [
            ([{"role": "user", "content": p}], {"prompt": p, "answer": a}) for p, a in records
        ]
        stream = iter(prompt_dataset(messages, engine.tokenizer, BUILTIN_TEMPLATE, width=40))
        rows = [next(stream) for _ in messages]  # the stream repeats its records forever
        prompts = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
        generator = torch.Generator().manual_seed(rank)
        with engine.autocast():
            batch, metrics = objective.prepare(engine.model, prompts, generator)
        results.append({"batch": batch, "metrics": metrics})
    return results


def test_unequal_row_widths_on_two_fsdp_ranks_give_one_process_rollouts(tmp_path: Path) -> None:
    """Each rank scores rows of its own width inside the gathered-weights region (once,
    before the fix, the entropy's no-grad chunks were sized per rank: rank 1 all-gathered for
    more forwards than rank 0 and the run hung; the entropy now comes from the training
    forward)."""
    single = run_on_ranks(_rollouts_on_rank, 1, _config(tmp_path / "single"))[0]
    fsdp = run_on_ranks(_rollouts_on_rank, 2, _config(tmp_path / "fsdp"), timeout=120)
    fsdp = [rank[0] for rank in fsdp]
    widths = [r["batch"]["input_ids"].shape[1] for r in single]
    assert widths[0] != widths[1]
    for got, want in zip(fsdp, single, strict=True):
        for key in ("input_ids", "labels", "advantages"):
            assert torch.equal(got["batch"][key], want["batch"][key]), key
        torch.testing.assert_close(
            got["batch"]["old_log_probs"], want["batch"]["old_log_probs"], rtol=1e-5, atol=1e-6
        )
        for name, value in want["metrics"].items():
            assert got["metrics"][name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def _train_rows(configs: list[Config]) -> list[dict[str, float]] | None:
    """Train each config in turn (the later ones resume the earlier ones' checkpoints);
    rank 0's metrics rows of the last folder."""
    import json

    from temper.trainer import Trainer

    for config in configs:
        trainer = Trainer(config)
        trainer.train()
    if not trainer.engine.runtime.is_main:
        return None
    path = Path(configs[-1].job.dump_folder) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _resume_config(folder: Path, steps: int) -> Config:
    config = _config(folder)
    config.lora.enable = True  # the reference is the policy with its adapters off
    config.training.steps = steps
    config.checkpoint.enable = True
    config.checkpoint.interval = 1
    config.objective.kl_coef = 0.1
    config.objective.updates_per_rollout = 2
    return config


@pytest.mark.slow
def test_grpo_resumed_between_two_updates_of_a_rollout_equals_the_uninterrupted_run(
    tmp_path: Path,
) -> None:
    """Two FSDP2 ranks (each with its own rollout rows) stop after step 1, the first of the
    rollout's two updates, and resume: step 2 logs what the uninterrupted run logs, to the
    bit. Before the fix it drew a new rollout from the next prompts."""
    whole = run_on_ranks(_train_rows, 2, [_resume_config(tmp_path / "whole", 2)])[0]
    folder = tmp_path / "resumed"
    configs = [_resume_config(folder, 1), _resume_config(folder, 2)]
    resumed = run_on_ranks(_train_rows, 2, configs)[0]
    by_step = {row["step"]: row for row in resumed}
    assert len(whole) == 2
    for row in whole[1:]:
        got = by_step[row["step"]]
        for name, value in row.items():
            if name not in TIMINGS and not name.startswith(MEASURED_PREFIXES):
                assert got[name] == value, (row["step"], name)


def _train_recording(config: Config, stop_share: int) -> dict[str, Any]:
    """Train ``config``, every ``stop_share``-th token id a stop token so rows (and ranks)
    finish decoding at different steps; this rank's rollouts, and rank 0's metrics."""
    import json

    from temper.trainer import Trainer

    trainer = Trainer(config)
    objective = trainer.objective
    vocab = trainer.engine.model.args.vocab_size
    objective.sampler.stop_tokens = set(range(1, vocab, stop_share))
    rollouts, prepare = [], objective.prepare

    def recording(
        model: torch.nn.Module, prompts: Any, generator: torch.Generator, engine: Any = None
    ) -> Any:
        batch, metrics = prepare(model, prompts, generator, engine)
        rollouts.append({k: v.clone() for k, v in batch.items()})
        return batch, metrics

    objective.prepare = recording
    trainer.train()
    path = Path(config.job.dump_folder) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {"rollouts": rollouts, "rows": rows if trainer.engine.runtime.is_main else None}


def _moe_config(folder: Path, ep: int) -> Config:
    config = _config(folder, model="qwen3_moe")
    config.parallelism.ep = ep
    config.training.steps = 2  # one rollout, its on-policy and its off-policy update
    config.optimizer.lr = 1e-4
    config.objective.kl_coef = 0.1  # a frozen reference, expert-parallel like the policy
    config.objective.updates_per_rollout = 2
    config.objective.rewards = ["test_brevity"]
    return config


def test_grpo_under_expert_parallelism_decodes_in_lockstep_like_one_process(
    tmp_path: Path,
) -> None:
    """Qwen3-MoE at EP 2 on two ranks against one process accumulating both ranks' prompts,
    two updates on one rollout:
    the rollouts equal token for token and every step's metrics within 1e-5, although the
    ranks stop decoding at different steps (each token's forward is an all-to-all between
    them: without lockstep decoding the rank that finishes first leaves the other waiting)."""
    single = run_on_ranks(_train_recording, 1, _moe_config(tmp_path / "single", 1), 7)[0]
    ep = run_on_ranks(_train_recording, 2, _moe_config(tmp_path / "ep", 2), 7, timeout=180)
    # One process rolls out micro-batch j as data rank j does.
    assert len(ep[0]["rollouts"]) == 1 and len(single["rollouts"]) == 2
    lengths = []
    for rank in range(2):
        got, want = ep[rank]["rollouts"][0], single["rollouts"][rank]
        assert torch.equal(got["input_ids"], want["input_ids"])
        assert torch.equal(got["labels"], want["labels"])
        for key in ("old_log_probs", "ref_log_probs", "advantages"):
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)
        lengths.append((want["labels"] != -100).sum(1).max().item())
    assert lengths[0] != lengths[1]  # the ranks stopped at different steps
    rows, reference = ep[0]["rows"], single["rows"]
    assert all(row["grad_norm"] > 0 for row in reference)  # rewards differed within groups
    assert_same_metrics(rows, reference)
    for row, ref in zip(rows, reference, strict=True):
        for name in ("reward_mean", "response_length", "entropy", "clip_fraction", "kl"):
            assert row[name] == pytest.approx(ref[name], rel=1e-5, abs=1e-7), name


def _train_recording_compiled(config: Config, stop_share: int) -> dict[str, Any]:
    """`_train_recording` with compiled rollouts, traced by a counting backend (no code
    generation); also the number of graphs the decoding step made."""
    from temper.generation import decoding

    graphs: list[torch.fx.GraphModule] = []

    def backend(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(graph)
        return graph.forward

    decoding._COMPILED[:] = [torch.compile(decoding.decode_step, backend=backend, dynamic=False)]
    config.objective.compile_rollouts = True
    return {**_train_recording(config, stop_share), "graphs": len(graphs)}


def test_grpo_under_expert_parallelism_with_compiled_rollouts_equals_one_eager_process(
    tmp_path: Path,
) -> None:
    """The lockstep case above with ``objective.compile_rollouts`` on the two EP ranks: the
    compiled decoding step breaks its graph around the eager all-to-all dispatch, and the
    rollouts and every step's metrics still equal one eager process's."""
    single = run_on_ranks(_train_recording, 1, _moe_config(tmp_path / "single", 1), 8)[0]
    config = _moe_config(tmp_path / "ep", 2)
    ep = run_on_ranks(_train_recording_compiled, 2, config, 8, timeout=300)
    for rank in range(2):
        got, want = ep[rank]["rollouts"][0], single["rollouts"][rank]
        assert ep[rank]["graphs"] > 1, rank  # the step ran compiled, in parts
        assert torch.equal(got["input_ids"], want["input_ids"])
        assert torch.equal(got["labels"], want["labels"])
        for key in ("old_log_probs", "ref_log_probs", "advantages"):
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)
    assert_same_metrics(ep[0]["rows"], single["rows"])


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_grpo_with_accumulation_on_two_data_ranks_rolls_out_like_one_process(
    tmp_path: Path, scale: str
) -> None:
    """Two FSDP2 ranks accumulating two one-row micro-batches each, against one process
    accumulating four: rank r's j-th micro-batch holds the global batch's row 2j + r and is
    sampled as the one process samples that row (the sampler was keyed by r * 2 + j, so rows
    1 and 2 drew each other's samples), and the step's metrics agree. With
    ``advantage_scale batch`` the advantages are divided by the std of all four micro-batches'
    rewards on both layouts."""
    configs = {}
    for name in ("single", "fsdp"):
        config = _config(tmp_path / name)
        config.training.global_batch_size = 4
        config.training.steps = 1
        config.objective.rewards = ["test_brevity"]
        config.objective.advantage_scale = scale
        configs[name] = config
    single = run_on_ranks(_train_recording, 1, configs["single"], 8)[0]
    fsdp = run_on_ranks(_train_recording, 2, configs["fsdp"], 8)
    assert len(single["rollouts"]) == 4
    for rank in range(2):
        for j, got in enumerate(fsdp[rank]["rollouts"]):
            want = single["rollouts"][2 * j + rank]
            assert torch.equal(got["input_ids"], want["input_ids"]), (rank, j)
            torch.testing.assert_close(got["sampler_log_probs"], want["sampler_log_probs"])
            torch.testing.assert_close(got["advantages"], want["advantages"])
    assert_same_metrics(fsdp[0]["rows"], single["rows"])


@pytest.mark.parametrize(
    ("model", "parallelism"),
    [
        ("llama3", {"sp": 2}),
        pytest.param("qwen3_moe", {"sp": 2, "ep": 2}, marks=pytest.mark.slow),
        ("deepseek_v4", {"sp": 2}),
    ],
    ids=["sp2", "sp2_ep2", "deepseek_v4-sp2"],
)
def test_grpo_under_sequence_parallelism_trains_like_one_process(
    tmp_path: Path, model: str, parallelism: dict[str, int]
) -> None:
    """Both SP ranks roll out the whole prompts (the same sampler: one data rank), training
    slices the rows: the rollouts equal one process's token for token, the steps' losses and
    gradient norms within 1e-5."""
    configs = {}
    for name, degrees in (("single", {}), ("sp", parallelism)):
        config = _moe_config(tmp_path / name, degrees.get("ep", 1))
        config.model.name = model
        config.parallelism.sp = degrees.get("sp", 1)
        configs[name] = config
    single = run_on_ranks(_train_recording, 1, configs["single"], 8)[0]
    sp = run_on_ranks(_train_recording, 2, configs["sp"], 8, timeout=180)
    for rank in sp:
        for got, want in zip(rank["rollouts"], single["rollouts"], strict=True):
            assert torch.equal(got["input_ids"], want["input_ids"])
            for key in ("old_log_probs", "ref_log_probs", "advantages"):
                # Log-probabilities of size 5-10 after two updates: 1e-5 relative.
                torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-4)
    rows, reference = sp[0]["rows"], single["rows"]
    assert all(row["grad_norm"] > 0 for row in reference)
    assert_same_metrics(rows, reference)
    for row, ref in zip(rows, reference, strict=True):
        for name in ("reward_mean", "response_length", "entropy"):
            assert row[name] == pytest.approx(ref[name], rel=1e-5, abs=1e-7), name


def _dpo_config(folder: Path, sp: int, loss_type: str, model: str | None = None) -> Config:
    from temper.recipes.posttrain import dpo_debug

    config = dpo_debug()
    config.model.name = model or config.model.name
    config.objective.loss_type = loss_type
    config.job.dump_folder = str(folder)
    config.checkpoint.initial_load = config.checkpoint.initial_recipe = None
    config.metrics.tensorboard = False
    config.parallelism.sp = sp
    config.training.steps = 2
    config.training.seq_len = 63  # not a multiple of SP: each side's slice is padded
    config.training.local_batch_size = 2
    config.training.global_batch_size = 2
    return config


@pytest.mark.slow
@pytest.mark.parametrize(
    ("loss_type", "model"),
    [("sigmoid", None), ("simpo", None), ("sigmoid", "deepseek_v4")],
    ids=["sigmoid", "simpo", "deepseek_v4-sigmoid"],
)
def test_dpo_under_sequence_parallelism_trains_like_one_process(
    tmp_path: Path, loss_type: str, model: str | None
) -> None:
    """SP 2 slices both sides of each pair; the slices' sequence sums (and, for the
    length-normalized simpo, answer lengths) meet over the SP group before the preference
    loss: the steps equal one process's within 1e-5 (the recipe's model, and DeepSeek V4,
    whose attention gathers the slices itself)."""
    single_config = _dpo_config(tmp_path / "single", 1, loss_type, model)
    single = run_on_ranks(_train_rows, 1, [single_config])[0]
    sp = run_on_ranks(_train_rows, 2, [_dpo_config(tmp_path / "sp", 2, loss_type, model)])[0]
    assert all(row["grad_norm"] > 0 for row in single)
    assert_same_metrics(sp, single)
    for row, ref in zip(sp, single, strict=True):
        # Differences of two sums of ~60 log-probabilities: 1e-5 absolute.
        for name in ("reward_margin", "rewards_chosen", "reward_accuracy"):
            assert row[name] == pytest.approx(ref[name], rel=1e-5, abs=1e-5), name
