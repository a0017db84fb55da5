"""DeepSeek's sparse attentions under context parallelism give one process's logits, loss,
indexer KL and gradients (gloo ranks, CPU).

DeepSeek sparse attention (V3.2, GLM-5): each rank's indexer scores its load-balanced queries
against the whole sequence's keys and the attention over the chosen keys all-gathers keys and
values (``context_parallel.GatherCore``); under CP x SP it runs inside Ulysses' all-to-alls.
DeepSeek V4: each layer's compressed attention gathers every rank's inputs in sequence order
and attends with the rank's own queries (``compressed_attention``), as under SP.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from training import assert_same_logits_loss_and_grads, families_against_one_process

DOCUMENTS = (5, 9, 7)
"""Packed rows of 21 tokens, padded to 24: at CP 2 four chunks of 6 (rank 0 holds columns
0-5 and 18-23, rank 1 6-17), so the documents starting at 5 and 14 cross chunks and ranks."""

OVERRIDES: dict[str, dict[str, Any]] = {
    # Each query keeps its 3 best keys of up to 9 visible ones: the selection matters.
    "deepseek_v32": {"indexer_training": "sparse", "index_topk": 3},
    # Layers 1 and 3 attend to the keys the layer before them chose.
    "glm_moe_dsa": {
        "indexer_training": "sparse",
        "index_topk": 3,
        "indexer_types": ("full", "shared", "full", "shared"),
    },
    # With a multi-token-prediction depth, whose next tokens cross the ranks too.
    "deepseek_v4": {"mtp_depth": 1},
}

V4_DOCUMENTS = (40, 23)
"""63 tokens padded to 64: at CP 2 chunks of 16, at CP 2 x SP 2 slices of 16. The first
document is longer than V4 debug's sliding window (32), holds 10 CSA windows (ratio 4, of
which each query keeps 8) and 2 HCA ones (16): window, compressed windows and the choice all
cross chunks and ranks."""


@pytest.mark.parametrize(
    ("layout", "world", "families"),
    [
        ("cp2", 2, ("deepseek_v32", "glm_moe_dsa")),
        ("cp2_sp2", 4, ("glm_moe_dsa",)),
    ],
)
def test_dsa_under_cp_gives_one_process_loss_kl_and_gradients(
    layout: str, world: int, families: tuple[str, ...]
) -> None:
    """The real tokens' logits, the loss with the weighted indexer KL, the KL itself and
    every gradient (summed over the ranks, the indexers' included) within 1e-5 of one
    process on the whole rows."""
    results = run_on_ranks(_rank, world, families, DOCUMENTS)[0]
    for family, (got, want) in zip(families, results, strict=True):
        assert_same_logits_loss_and_grads(family, got, want)
        # The KL (3e-4 here) is a small difference of fp32 terms of order one per query
        # (xlogy(p, p) - p log q): the ranks' other matmul shapes move it by ~1e-8 (measured),
        # a query's wrong row or keys by about its own size.
        kl, want_kl = got["metrics"]["indexer_kl"], want["metrics"]["indexer_kl"]
        assert kl == pytest.approx(want_kl, rel=1e-5, abs=1e-7), family
        assert want_kl > 1e-4
        indexer = [name for name in want["grads"] if ".indexer." in name]
        assert indexer and all(want["grads"][name].abs().max() > 0 for name in indexer)


@pytest.mark.parametrize(("layout", "world"), [("cp2", 2), ("cp2_sp2", 4)])
def test_deepseek_v4_under_cp_gives_one_process_loss_and_gradients(layout: str, world: int) -> None:
    """V4 debug with an MTP depth: the real tokens' logits, the loss (the draft's included),
    the draft's loss and every gradient (summed over the ranks) within 1e-5 of one process on
    the whole rows. The hyper-connections' scalars get gradients that cancel from O(1) terms
    (as in test_deepseek_v4_parallel): fp32 summed in another order leaves up to 1.6e-7 there
    (measured, at most 2.7e-4 of their largest entry), hence a 1e-6 absolute floor."""
    ((got, want),) = run_on_ranks(_rank, world, ("deepseek_v4",), V4_DOCUMENTS)[0]
    torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["metrics"]["mtp_loss"] == pytest.approx(want["metrics"]["mtp_loss"], rel=1e-5)
    assert got["grads"].keys() == want["grads"].keys()
    for name, grad in got["grads"].items():
        atol = max(1e-5 * want["grads"][name].abs().max().item(), 1e-6)
        torch.testing.assert_close(grad, want["grads"][name], rtol=1e-5, atol=atol, msg=name)


def _rank(
    families: tuple[str, ...], documents: tuple[int, ...]
) -> list[tuple[dict[str, Any], dict[str, Any]]] | None:
    from temper.config import Parallelism
    from temper.parallel.context_parallel import ContextParallel, unshard
    from temper.parallel.dims import ParallelDims
    from temper.utils.device import init_runtime

    init_runtime()
    sp = dist.get_world_size() // 2
    if sp == 1:
        rows = dist.group.WORLD
        layout = ContextParallel(rows)
    else:
        dims = ParallelDims.from_config(Parallelism(cp=2, sp=sp), 4, dist.get_rank())
        world = dims.build_meshes("cpu").world
        rows = world["cp_sp"].get_group()
        layout = ContextParallel(world["cp"].get_group(), world["sp"].get_group(), rows)

    def gather(x: torch.Tensor) -> torch.Tensor:
        """Whole rows from every rank's tokens: each CP rank's SP slices joined, then the CP
        layout undone."""
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(rows))]
        dist.all_gather(parts, x.contiguous(), group=rows)
        return unshard([torch.cat(parts[i : i + sp], dim=1) for i in range(0, len(parts), sp)])

    results = []
    for family in families:
        got = families_against_one_process(layout, (family,), documents, gather, OVERRIDES[family])
        results += got or []
    return results if dist.get_rank() == 0 else None
