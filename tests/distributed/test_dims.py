"""ParallelDims: every wrong combination named before any model exists; the meshes it builds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import run_on_ranks

from temper.config import ConfigError, Parallelism
from temper.data import build_text_loader, load_tokenizer
from temper.parallel.dims import ParallelDims
from temper.recipes.llama3 import llama3_debug
from temper.trainer import Trainer
from temper.utils.device import Runtime

ROOT = Path(__file__).resolve().parents[2]


def dims(world_size: int, **degrees: int) -> ParallelDims:
    return ParallelDims.from_config(Parallelism(**degrees), world_size)


def test_dp_shard_takes_the_rest_of_the_world() -> None:
    d = dims(8, dp_replicate=2, sp=2, ep=2)
    assert (d.dp_replicate, d.dp_shard, d.sp, d.ep) == (2, 2, 2, 2)
    assert (d.dp, d.fsdp, d.efsdp) == (4, 4, 2)
    assert dims(1).sharded is False and dims(2).sharded is True
    d = dims(8, cp=2, sp=2)
    assert (d.dp_shard, d.dp, d.fsdp) == (2, 2, 8)
    assert [d.data_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize(
    ("world", "degrees", "message"),
    [
        (8, {"dp_replicate": 3}, r"world size 8 is not divisible by .* \(3 x 1 x 1\)"),
        (4, {"dp_shard": 3}, "dp_shard x cp x sp = 1 x 3 x 1 x 1 does not equal .* 4"),
        (4, {"dp_shard": 2}, "1 x 2 x 1 x 1 does not equal the world size 4"),
        (4, {"ep": 3}, r"parallelism.ep \(3\) must divide .* \(4 x 1 x 1 = 4\)"),
        (8, {"dp_replicate": 2, "ep": 8}, r"parallelism.ep \(8\) must divide .* \(4 x 1 x 1 = 4\)"),
        (4, {"dp_shard": -2}, "parallelism.dp_shard must be -1 or >= 1, got -2"),
        (4, {"sp": 0}, "parallelism.sp must be >= 1, got 0"),
        (4, {"cp": 0}, "parallelism.cp must be >= 1, got 0"),
        (8, {"cp": 3}, r"world size 8 is not divisible by .*parallelism.cp .* \(1 x 3 x 1\)"),
        (4, {"cp": 2, "ep": 8}, r"parallelism.ep \(8\) must divide .* \(2 x 2 x 1 = 4\)"),
        (0, {}, "world size must be >= 1, got 0"),
    ],
)
def test_wrong_combinations_name_fields_and_numbers(
    world: int, degrees: dict[str, int], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        dims(world, **degrees)


def test_trainer_refuses_a_layout_before_building_anything(tmp_path: Path) -> None:
    config = llama3_debug()
    config.job.dump_folder = str(tmp_path / "run")
    config.parallelism.dp_shard = 3
    runtime = Runtime(device=torch.device("cpu"), rank=0, local_rank=0, world_size=4)
    with pytest.raises(ConfigError, match="1 x 3 x 1 x 1 does not equal the world size 4"):
        Trainer(config, runtime=runtime)
    assert not (tmp_path / "run").exists()


def test_run_train_preflight_names_the_layout_before_any_rank_starts(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(ROOT / "run_train.sh"), "--parallelism.dp_shard", "3"],
        cwd=tmp_path,
        env={**os.environ, "TEMPER_PYTHON": sys.executable, "NGPU": "2"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "1 x 3 x 1 x 1 does not equal the world size 2" in result.stderr
    assert "torch.distributed.run" not in result.stderr and not (tmp_path / "outputs").exists()


def test_ranks_of_one_sp_group_read_the_same_batches() -> None:
    """World 8 as 2 replicas x 2 shards x 2 SP ranks: 4 data shards, each read by a pair."""
    d = dims(8, dp_replicate=2, sp=2)
    tokenizer = load_tokenizer(None)
    first = [
        next(iter(build_text_loader(tokenizer, 16, 2, dp_rank=d.data_rank(r), dp_world=d.dp)))
        for r in range(8)
    ]
    for r in range(0, 8, 2):
        assert torch.equal(first[r]["input_ids"], first[r + 1]["input_ids"])
    distinct = {tuple(first[r]["input_ids"].flatten().tolist()) for r in range(8)}
    assert len(distinct) == 4


def _mesh_groups(layouts: list[dict[str, int]]) -> list[dict[str, object]]:
    """This rank's groups in every mesh of each layout, as lists of global ranks."""
    import torch.distributed as dist

    dist.init_process_group("gloo")

    def ranks(mesh: torch.distributed.device_mesh.DeviceMesh) -> list[int]:
        return sorted(mesh.mesh.flatten().tolist())

    found = []
    for degrees in layouts:
        d = ParallelDims.from_config(Parallelism(**degrees), dist.get_world_size())
        meshes = d.build_meshes("cpu")
        groups = {
            "sp": ranks(meshes.world["sp"]),
            "cp": ranks(meshes.world["cp"]),
            "dp_shard": ranks(meshes.world["dp_shard"]),
            "replicate": ranks(meshes.hsdp["dp_replicate"]),
            "fsdp": ranks(meshes.hsdp["fsdp"]),
            "fsdp_mesh_dims": meshes.fsdp.mesh_dim_names,
            "data_rank": d.data_rank(dist.get_rank()),
        }
        if meshes.expert is not None:
            groups |= {
                "ep": ranks(meshes.expert["ep"]),
                "efsdp": ranks(meshes.expert["efsdp"]),
                "edp": ranks(meshes.expert["edp"]),
            }
        found.append(groups)
    return found


@pytest.mark.slow
def test_meshes_group_the_ranks_of_each_dimension() -> None:
    """World 4 as 2 shards x 2 SP ranks with ep 2, then as 2 replicas x 2 shards (HSDP), then
    as 2 CP x 2 SP ranks (one data shard)."""
    layouts = [{"sp": 2, "ep": 2}, {"dp_replicate": 2}, {"cp": 2, "sp": 2}]
    by_rank = run_on_ranks(_mesh_groups, 4, layouts)
    sp, hsdp, cp = zip(*by_rank, strict=True)
    assert [g["sp"] for g in sp] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["dp_shard"] for g in sp] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g["data_rank"] for g in sp] == [0, 0, 1, 1]
    assert all(g["fsdp"] == [0, 1, 2, 3] and g["fsdp_mesh_dims"] == ("fsdp",) for g in sp)
    assert [g["ep"] for g in sp] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["efsdp"] for g in sp] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g["edp"] for g in sp] == [[0], [1], [2], [3]]

    assert [g["replicate"] for g in hsdp] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g["fsdp"] for g in hsdp] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(g["fsdp_mesh_dims"] == ("dp_replicate", "fsdp") for g in hsdp)
    assert [g["data_rank"] for g in hsdp] == [0, 1, 2, 3]
    assert all("ep" not in g for g in hsdp)

    assert [g["sp"] for g in cp] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["cp"] for g in cp] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(g["fsdp"] == [0, 1, 2, 3] and g["data_rank"] == 0 for g in cp)


def _expert_init_draw(seed: int) -> tuple[torch.Tensor, list[str]]:
    import logging

    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    from temper.parallel.sharded_init import layout_invariant_init

    dist.init_process_group("gloo")
    d = ParallelDims.from_config(Parallelism(ep=2), dist.get_world_size())
    mesh = d.build_meshes("cpu").expert["efsdp", "ep"]
    weight = distribute_tensor(torch.zeros(8, 6), mesh, [Shard(0), Shard(0)])
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("torch.distributed.tensor._redistribute").addHandler(handler)
    torch.manual_seed(seed)
    with layout_invariant_init():
        torch.nn.init.trunc_normal_(weight, std=2.0, a=-1.0, b=1.0)
    return weight.full_tensor(), messages


def test_expert_init_is_one_process_draw_in_one_collective_per_read() -> None:
    """trunc_normal_ on expert weights sharded over efsdp x ep draws one process's numbers,
    and its whole-tensor reads run as one collective: DTensor warns of none run per mesh dim."""
    torch.manual_seed(3)
    expected = torch.nn.init.trunc_normal_(torch.zeros(8, 6), std=2.0, a=-1.0, b=1.0)
    for weight, messages in run_on_ranks(_expert_init_draw, 2, 3):
        torch.testing.assert_close(weight, expected, rtol=0, atol=0)
        assert not [m for m in messages if "sequential" in m], messages


def _layer_init_draw(seed: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from temper.models.layers.init import trunc_normal_
    from temper.parallel.sharded_init import layout_invariant_init

    dist.init_process_group("gloo")
    d = ParallelDims.from_config(Parallelism(ep=2), dist.get_world_size())
    mesh = d.build_meshes("cpu").expert["efsdp", "ep"]
    weight = distribute_tensor(torch.zeros(8, 6), mesh, [Shard(0), Shard(0)])
    torch.manual_seed(seed)
    # Entered first, so it also sees what the init mode runs.
    with CommDebugMode() as layers, layout_invariant_init():
        trunc_normal_(weight, std=2.0)
    in_mode = weight.full_tensor()
    torch.manual_seed(seed)
    with CommDebugMode() as plain:
        trunc_normal_(weight, std=2.0)
    alone = weight.full_tensor()
    with CommDebugMode() as read_whole:  # the counter sees DTensor's collectives
        weight.full_tensor()
    return (
        in_mode,
        alone,
        layers.get_total_counts() + plain.get_total_counts(),
        read_whole.get_total_counts(),
    )


def test_layer_init_draws_one_process_numbers_without_collectives() -> None:
    """The layers' trunc_normal_ draws into a whole plain tensor and a sharded weight takes
    its part: one process's numbers, under the Engine's init mode or not, and no collective
    (torch 2.13's rejection sampler, run on the DTensor, reads it whole after each pass)."""
    torch.manual_seed(3)
    expected = torch.nn.init.trunc_normal_(torch.zeros(8, 6), std=2.0, a=-6.0, b=6.0)
    for in_mode, alone, ours, read_whole in run_on_ranks(_layer_init_draw, 2, 3):
        torch.testing.assert_close(in_mode, expected, rtol=0, atol=0)
        torch.testing.assert_close(alone, expected, rtol=0, atol=0)
        assert ours == 0 and read_whole > 0, (ours, read_whole)
