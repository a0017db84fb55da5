"""The dry run against independent counts: shard sizes against torch.chunk and the
parameters' own local shards, activation bytes against what autograd saves in a real CPU
forward of the same model, communication against a hand count, errors against the rules."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import temper.engine  # noqa: F401  (registers the built-in rules)
from temper.config import load_config
from temper.engine.engine import build_run_model, load_run_tokenizer
from temper.models.layers.moe import moe_layers
from temper.objectives import CausalLM
from temper.parallel.dims import ParallelDims
from temper.parallel.parallelize import parallelize_decoder
from temper.plan import main, plan_run
from temper.plan.activations import measure_activations, planned_kernels
from temper.plan.layout import describe_params, rank_coordinates
from temper.utils.compat import init_fake_process_group

MODULES = {"llama3": "llama3", "qwen3": "qwen3", "deepseek": "deepseek_v3"}


def config_of(recipe: str, *argv: str):
    module = f"temper.recipes.{MODULES[recipe.split('_')[0]]}"
    args = ["--training.seq_len", "32", "--training.local_batch_size", "2", *argv]
    return load_config(module, recipe, args, validate=False)


@pytest.fixture
def fake_world():
    """A fake process group of ``world`` ranks as rank ``rank``; destroyed afterwards."""

    def start(world: int, rank: int = 0) -> None:
        init_fake_process_group(rank, world)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


CASES = [
    # World 3 splits the 256-row weights unevenly (86, 86, 84 rows).
    ("llama3_debug", 3, [], 0),
    ("llama3_debug", 3, [], 2),
    # Experts: Shard over ep, then FSDP2's strided shard over efsdp.
    ("qwen3_moe_debug", 4, ["--parallelism.ep", "2"], 0),
    ("qwen3_moe_debug", 4, ["--parallelism.ep", "2"], 3),
]


@pytest.mark.parametrize(("recipe", "world", "argv", "rank"), CASES)
def test_shard_sizes_match_the_real_local_shards(fake_world, recipe, world, argv, rank) -> None:
    config = config_of(recipe, *argv)
    dims = ParallelDims.from_config(config.parallelism, world, rank=rank)
    fake_world(world, rank)
    model = build_run_model(config, load_run_tokenizer(config))
    meshes = dims.build_meshes("cpu")
    parallelize_decoder(model, config, meshes, torch.float32)
    shards = describe_params(model, "adamw")
    coords = rank_coordinates(meshes, world)
    for p in model.parameters():
        shard = shards[id(p)]
        assert shard.local_numel(coords[rank]) == p.to_local().numel()
        across = sum(shard.local_numel(coords[r]) for r in range(world))
        assert across == p.numel()  # no replica: each element on exactly one rank
    if world == 3:
        weight = model.layers[0].attention.wq.weight
        sizes = [shards[id(weight)].local_numel(coords[r]) for r in range(world)]
        assert sizes == [c.numel() for c in torch.empty(weight.shape).chunk(3)]


def saved_bytes_on_cpu(model: nn.Module, ids: torch.Tensor, objective: CausalLM) -> tuple[int, int]:
    """(bytes autograd saves inside the blocks, outside them) in a real CPU forward of
    ``objective``'s loss, each storage once, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set(params)
    totals = {"in": 0, "out": 0}
    where = ["out"]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            totals[where[0]] += storage.nbytes()
        return t

    for block in model.layers:
        block.register_forward_pre_hook(lambda m, a: where.__setitem__(0, "in"))
        block.register_forward_hook(lambda m, a, o: where.__setitem__(0, "out"))
    kept = []  # keep every saved storage alive: no address is reused
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or pack(t), lambda t: t):
        loss, _, _ = objective.loss(model, {"input_ids": ids, "labels": ids})
    return totals["in"], totals["out"]


@pytest.mark.parametrize(
    ("recipe", "seq_len"),
    [
        ("llama3_debug", 32),
        ("qwen3_moe_debug", 32),
        ("deepseek_v3_debug", 32),
        ("llama3_debug", 600),
        ("deepseek_v3_debug", 600),
    ],
)
def test_meta_activations_equal_what_a_real_forward_saves(recipe, seq_len) -> None:
    """On CPU: MLA's values are shorter than its keys, so sdpa takes its math path and saves
    the softmax; the plan counts that too, and at 600 tokens in the row chunks the CPU run
    takes (three, the last 88 rows), whether flash (Llama) or math (MLA) runs each."""
    config = config_of(recipe)
    model = build_run_model(config, load_run_tokenizer(config))
    objective = CausalLM(kernels=planned_kernels(config.kernels, "cpu"))
    measured = measure_activations(config, model, objective, (2, seq_len), "cpu")
    real = build_run_model(config, load_run_tokenizer(config)).to_empty(device="cpu")
    real.init_weights()
    real.attn_backend = "sdpa"
    torch.manual_seed(0)
    ids = torch.randint(0, 600, (2, seq_len))
    inside, outside = saved_bytes_on_cpu(real, ids, objective)
    # The one difference: the real grouped GEMM also saves its [n_experts] int32 offsets.
    offsets = sum(4 * m.n_experts for m in moe_layers(real).values())
    assert sum(b.saved for b in measured.blocks) == inside - offsets
    assert measured.outside == outside
    assert all(b.input == 2 * seq_len * real.args.dim * 4 for b in measured.blocks)


def test_communication_by_hand(fake_world) -> None:
    """World 2, fp32, nothing resharded: each unit is gathered once and its gradient
    reduce-scattered once per micro-batch, half of each arriving from the other rank."""
    config = config_of(
        "llama3_debug",
        "--parallelism.fsdp_reshard_after_forward",
        "never",
        "--training.global_batch_size",
        "8",
    )
    plan = plan_run(config, 2, "cpu")
    assert plan.errors == [] and plan.grad_accum == 2
    total = sum(p.numel() for p in build_run_model(config, load_run_tokenizer(config)).parameters())
    comm = plan.communication
    assert comm.all_gather == pytest.approx(2 * total * 4 / 2)
    assert comm.reduce_scatter == pytest.approx(2 * total * 4 / 2)
    assert comm.all_reduce == comm.all_to_all_ep == comm.all_to_all_sp == 0


def test_expert_all_to_all_by_hand() -> None:
    config = config_of("qwen3_moe_debug", "--parallelism.ep", "4")
    plan = plan_run(config, 4, "cpu")
    model = build_run_model(config, load_run_tokenizer(config))
    n_moe = sum(1 for name, _ in model.named_modules() if name.endswith("feed_forward.experts"))
    top_k, dim = model.args.top_k, model.args.dim
    # Dispatch and combine, forward and backward: 4 exchanges of 2 x 32 tokens x top_k rows,
    # the busiest rank receiving its imbalance's share in two of them.
    imbalance = plan.ep_imbalance
    expected = (2 * imbalance + 2) * n_moe * 2 * 32 * top_k * dim * 4 * 3 / 4
    assert plan.communication.all_to_all_ep == pytest.approx(expected)


def test_ring_attention_by_hand() -> None:
    """CP 2 on 30 tokens: each rank plans 16 (two chunks of 8 after padding to 32), and per
    micro-batch the ring moves each layer's k and v once forward and once backward, and
    their fp32 gradients twice."""
    config = config_of("llama3_debug", "--parallelism.cp", "2", "--training.seq_len", "30")
    plan = plan_run(config, 2, "cpu")
    assert plan.errors == [] and plan.tokens == (2, 16)
    model = build_run_model(config, load_run_tokenizer(config))
    args = model.args
    head_dim = args.dim // args.n_heads
    kv = args.n_layers * 2 * (2 * 16 * args.n_kv_heads * head_dim * 4)
    assert plan.communication.ring_cp == pytest.approx(plan.grad_accum * kv * (2 + 2))
    assert plan.communication.all_to_all_sp == 0


def test_ring_passes_only_attention_layers_kv() -> None:
    """Qwen3.5 debug, CP 2 on 64 tokens (a rank's 32): the ring passes k and v of its one
    full-attention layer; its three Gated DeltaNet layers pass their state, not k and v."""
    config = load_config(
        "temper.recipes.qwen3_5",
        "qwen3_5_debug",
        ["--parallelism.cp", "2", "--training.seq_len", "64"],
        validate=False,
    )
    plan = plan_run(config, 2, "cpu")
    rows, length = plan.tokens
    assert plan.errors == [] and length == 32
    args = build_run_model(config, load_run_tokenizer(config)).args
    attention_layers = args.layer_types.count("full_attention")
    assert attention_layers == 1 < args.n_layers
    kv = attention_layers * 2 * (rows * length * args.n_kv_heads * args.head_dim * 4)
    assert plan.communication.ring_cp == pytest.approx(plan.grad_accum * kv * (2 + 2))


def test_ulysses_all_to_all_by_hand() -> None:
    """SP 2 on 600 tokens: per micro-batch each layer's q, k, v and output at a rank's 300
    tokens go out once forward and once backward, half to the other rank; counted once per
    layer although CPU attention runs in row chunks."""
    config = config_of("llama3_debug", "--parallelism.sp", "2", "--training.seq_len", "600")
    plan = plan_run(config, 2, "cpu")
    rows, length = plan.tokens
    assert plan.errors == [] and length == 300
    args = build_run_model(config, load_run_tokenizer(config)).args
    head_dim = args.dim // args.n_heads
    per_layer = rows * length * head_dim * 4 * (2 * args.n_heads + 2 * args.n_kv_heads)
    expected = plan.grad_accum * 2 * args.n_layers * per_layer / 2
    assert plan.communication.all_to_all_sp == pytest.approx(expected)


def test_cp_with_sp_plans_each_ranks_slice() -> None:
    """CP 2 x SP 2 on 30 tokens: padded to 32 (a multiple of 2 x cp x sp), each CP rank's 16
    tokens cut into two SP slices of 8, which is what a rank plans; SP's all-to-alls and the
    ring both move bytes."""
    config = config_of(
        "llama3_debug", "--parallelism.cp", "2", "--parallelism.sp", "2", "--training.seq_len", "30"
    )
    plan = plan_run(config, 4, "cpu")
    assert plan.errors == [] and plan.tokens == (config.training.local_batch_size, 8)
    assert plan.communication.ring_cp > 0 and plan.communication.all_to_all_sp > 0


def test_state_bytes_sum_to_the_model_over_ranks_and_replicas() -> None:
    config = config_of(
        "qwen3_moe_debug", "--parallelism.ep", "2", "--parallelism.dp_replicate", "2"
    )
    plan = plan_run(config, 8, "cpu")
    total = sum(p.numel() for p in build_run_model(config, load_run_tokenizer(config)).parameters())
    assert sum(r.state.params for r in plan.ranks) == 2 * total * 4  # two replicas
    assert all(r.state.optimizer == 2 * r.state.grads for r in plan.ranks)  # AdamW: 2 states
    assert plan.communication.all_reduce > 0


def test_every_config_error_is_listed(capsys) -> None:
    config = config_of("qwen3_moe_debug", "--parallelism.ep", "3", "--training.steps", "0")
    plan = plan_run(config, 4, "cuda")
    assert len(plan.errors) == 3
    assert any("training.steps must be > 0" in e for e in plan.errors)
    assert any("parallelism.ep (3) must divide parallelism.dp_shard" in e for e in plan.errors)
    assert any("parallelism.ep (3) must divide the number of experts" in e for e in plan.errors)
    argv = ["--module", "temper.recipes.qwen3", "--config", "qwen3_moe_debug", "--world_size", "4"]
    assert main([*argv, "--parallelism.ep", "3"]) == 2
    assert "parallelism.ep (3) must divide" in capsys.readouterr().out


def test_a_256_rank_plan_prints_per_rank_groups(capsys) -> None:
    argv = ["--module", "temper.recipes.qwen3", "--config", "qwen3_moe_debug"]
    assert (
        main([*argv, "--world_size", "256", "--parallelism.ep", "8", "--training.seq_len", "64"])
        == 0
    )
    out = capsys.readouterr().out
    assert "dp_shard 256" in out and "ep 8 (efsdp 32)" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    spans = [line.split("|")[1].strip() for line in rows]
    covered = sum(int(s.split("-")[-1]) - int(s.split("-")[0]) + 1 for s in spans)
    assert covered == 256


def test_train_dry_run_flag_plans_instead_of_training(tmp_path, capsys) -> None:
    from temper.train import main as train

    argv = ["--dry_run", "--world_size", "2", "--device", "cpu"]
    assert train([*argv, "--job.dump_folder", str(tmp_path / "run")]) == 0
    assert "world 2 on cpu" in capsys.readouterr().out
    assert not (tmp_path / "run").exists()  # nothing trained, no run folder
