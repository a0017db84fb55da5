"""Muon under FSDP2, HSDP and expert parallelism trains the model one process trains.

Newton-Schulz runs in float32 here: in bfloat16 (the default) the last-bit differences of
fp32 gradients summed in another order round to different bf16 values now and then, and the
losses part by ~1e-5..1e-4 within five steps, although every matrix is orthogonalized by the
same code from its whole update.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from harness import run_on_ranks
from test_expert_parallel import EP2, EP2_EFSDP2, SINGLE8, moe_config
from training import FSDP2, HSDP2X2, SINGLE, Layout, Run, assert_same_metrics, parity_config
from training import train as train_layout

from temper.config import Config
from temper.optim.sharded_matrices import assign_owners, rows_of
from temper.recipes.deepseek_v3 import deepseek_v3_debug
from temper.recipes.llama3 import llama3_debug
from temper.recipes.qwen3 import qwen3_moe_debug


def with_muon(config: Config) -> Config:
    config.optimizer.name = "muon"
    config.optimizer.muon_ns_dtype = "float32"
    config.optimizer.lr = 3e-3  # large enough that three steps move the loss a lot
    config.lr_scheduler.warmup_steps = 1
    return config


def _config(recipe: Callable[[], Config], folder: Path, layout: Layout, qk_clip: float) -> Config:
    if recipe is llama3_debug:
        config = with_muon(parity_config(recipe, folder, layout))
    else:
        config = with_muon(moe_config(recipe, folder, layout))
    config.optimizer.muon_qk_clip = qk_clip
    return config


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, float], Run]:
    return {}


def _case(recipe: Callable[[], Config], layout: Layout, slow: bool, qk_clip: float = 0.0) -> object:
    marks = (pytest.mark.slow,) if slow else ()
    name = f"{recipe.__name__}-{layout.name}" + ("-qk_clip" if qk_clip else "")
    return pytest.param(recipe, layout, qk_clip, id=name, marks=marks)


# 0.35 is about the median of the debug Llama's per-head maxima at init: QK-clip scales about
# half the heads at every step (tests/unit/test_muon.py checks the scaling itself).
@pytest.mark.parametrize(
    ("recipe", "layout", "qk_clip"),
    [
        _case(llama3_debug, FSDP2, slow=False),
        _case(llama3_debug, HSDP2X2, slow=True),
        _case(llama3_debug, FSDP2, slow=True, qk_clip=0.35),
        _case(qwen3_moe_debug, EP2, slow=False),
        _case(deepseek_v3_debug, EP2_EFSDP2, slow=True),
    ],
)
def test_muon_layouts_train_like_one_process(
    recipe: Callable[[], Config],
    layout: Layout,
    qk_clip: float,
    tmp_path_factory: pytest.TempPathFactory,
    references: dict[tuple[str, float], Run],
) -> None:
    folder = tmp_path_factory.getbasetemp() / "muon" / f"{recipe.__name__}-{qk_clip}"
    single = SINGLE if recipe is llama3_debug else SINGLE8

    def reference(clip: float) -> Run:
        key = (recipe.__name__, clip)
        if key not in references:
            where = tmp_path_factory.getbasetemp() / "muon" / f"{recipe.__name__}-{clip}"
            references[key] = train_layout(_config(recipe, where, single, clip), single)
        return references[key]

    run = train_layout(_config(recipe, folder, layout, qk_clip), layout)
    assert run.fsdp_units  # sharded: the matrices' rows are split over ranks
    assert_same_metrics(run.rows, reference(qk_clip).rows)
    if qk_clip:  # the clipping changed the run: by 10x the parity tolerance at some step
        # (gradient norms: QK-clip moves them by ~1e-3 here, the last loss by only ~5e-5)
        unclipped = reference(0.0).rows
        assert any(
            row["grad_norm"] != pytest.approx(ref["grad_norm"], rel=1e-4)
            for row, ref in zip(run.rows, unclipped, strict=True)
        )
    assert run.rows[-1]["loss"] < run.rows[0]["loss"]  # and it trains


SHAPES = [(8, 6), (5, 4), (3, 7), (12, 4), (1, 3)]  # uneven rows; one shard of (1, 3) is empty


def _exchange_rank(assign: str) -> tuple[list[torch.Tensor], list[torch.Tensor], int, object]:
    """HSDP 2 x 2: each rank passes its rows of every matrix; returns (its rows of each
    result, the same rows of the function applied to the whole matrix, calls run here,
    byte counts)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from temper.optim.sharded_matrices import CommStats, RowShardedMatrices, rows_of

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "fsdp"))
    shard = mesh.get_coordinate()[1]
    generator = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=generator) for s in SHAPES]
    local = [m.narrow(0, *rows_of(m.shape[0], 2, shard)) for m in full]
    calls = []

    def fn(matrix: torch.Tensor) -> torch.Tensor:
        calls.append(matrix.shape)
        return matrix @ matrix.T @ matrix + 1.0  # needs every row, like Newton-Schulz

    stats = CommStats()
    out = RowShardedMatrices(mesh, 1).orthogonalize(
        local, [m.shape for m in full], fn, dtype=torch.float32, assign=assign, stats=stats
    )
    want = [(m @ m.T @ m + 1.0).narrow(0, *rows_of(m.shape[0], 2, shard)) for m in full]
    return out, want, len(calls), stats


@pytest.mark.parametrize("assign", ["size", "round_robin"])
def test_each_matrix_is_computed_once_and_every_rank_gets_its_rows(assign: str) -> None:
    results = run_on_ranks(_exchange_rank, 4, assign)
    for out, want, _, _ in results:
        for got, expected in zip(out, want, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert sum(calls for _, _, calls, _ in results) == len(SHAPES)  # once each, not 4 times
    # Bytes over all ranks, by hand (fp32, 4 bytes): the owner (shard s of its replica)
    # receives the other shard's rows; every other rank, both replicas, receives its rows of
    # the result. Gathering everything everywhere brings each of the 4 ranks the other
    # shard's rows: twice each matrix.
    stats = [s for *_, s in results]
    owners = assign_owners([torch.Size(s) for s in SHAPES], 4, assign)
    expected = 0
    for (rows, cols), owner in zip(SHAPES, owners, strict=True):
        own = rows_of(rows, 2, owner % 2)[1] * cols  # positions are (replica, shard) row-major
        expected += 4 * (3 * rows * cols - 2 * own)
    assert sum(s.received for s in stats) == sum(s.sent for s in stats) == expected
    assert sum(s.all_gather_received for s in stats) == 4 * 2 * sum(r * c for r, c in SHAPES)
    assert [s.matrices for s in stats] == [owners.count(p) for p in range(4)]
