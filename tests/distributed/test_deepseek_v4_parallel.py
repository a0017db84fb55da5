"""DeepSeek V4 trains under Ulysses sequence parallelism as one process does.

Each rank gathers every slice's attention inputs for the shared KV head, the sliding window,
the compressors and the CSA indexer, and attends with its own slice's queries
(``temper.models.layers.compressed_attention``). The debug model (sliding window 32, CSA
ratio 4 keeping 8 entries, HCA ratio 16), fp32, random init: at 64 tokens split 32 + 32 the
window, the compressed windows and the top-k choice all cross the slice boundary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from harness import run_on_ranks
from padded_slices import padded_slices_rank
from training import Layout, assert_same_metrics, parity_config
from training import train as train_layout

from temper.config import Config
from temper.recipes.deepseek_v4 import deepseek_v4_debug, deepseek_v4_debug_mtp

SINGLE8 = Layout("single8", world=1, local_batch=8)
SP2_EP2 = Layout("sp2_ep2", world=4, local_batch=4, parallelism={"sp": 2, "ep": 2})


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [deepseek_v4_debug, deepseek_v4_debug_mtp], ids=["plain", "mtp"])
def test_sequence_and_expert_parallel_v4_trains_like_one_process(
    tmp_path_factory: pytest.TempPathFactory, recipe: Callable[[], Config]
) -> None:
    """SP 2 x EP 2 over four ranks: every step's loss and gradient norm of one process
    training the same 8 rows of 64 tokens as one micro-batch (1e-5), with and without a
    multi-token-prediction depth trained jointly (its loss is in the loss)."""
    folder = tmp_path_factory.getbasetemp() / recipe.__name__
    runs = {
        layout.name: train_layout(parity_config(recipe, folder, layout), layout)
        for layout in (SINGLE8, SP2_EP2)
    }
    if recipe is deepseek_v4_debug_mtp:
        assert all("mtp_loss" in row for row in runs["single8"].rows)
        for row, ref in zip(runs["sp2_ep2"].rows, runs["single8"].rows, strict=True):
            assert row["mtp_loss"] == pytest.approx(ref["mtp_loss"], rel=1e-5)
    assert_same_metrics(runs["sp2_ep2"].rows, runs["single8"].rows)


@pytest.mark.parametrize(
    ("packed", "mtp_depth"), [(False, 0), (True, 0), (True, 1)], ids=["rows", "packed", "mtp"]
)
def test_padded_slices_give_one_process_gradients(packed: bool, mtp_depth: int) -> None:
    """79 tokens (packed: documents of 70 and 9) padded to 80 over 2 SP ranks: the loss, the
    routing's aux loss and every parameter's gradient equal one process's on the unpadded
    rows; with an MTP depth too (its next tokens and targets cross the slices' boundary, its
    wrapped last columns are the real tokens' as one process's). The loss is a sum over 158
    tokens, so the hyper-connections' few scalars get gradients that cancel from O(1) terms:
    fp32 summed in another order leaves up to 2e-7 there (measured), hence the 1e-6 absolute
    floor; a misplaced window or entry moves the logits by 1e-2."""
    got, want = run_on_ranks(_padded_batch_rank, 2, packed, mtp_depth)[0]
    assert got["loss"].item() == pytest.approx(want["loss"].item(), rel=1e-6)
    assert got["aux"].item() == pytest.approx(want["aux"].item(), rel=1e-6)
    assert got["grads"].keys() == want["grads"].keys()
    for name, grad in got["grads"].items():
        scale = want["grads"][name].abs().max().item()
        atol = max(1e-5 * scale, 1e-6)
        torch.testing.assert_close(grad, want["grads"][name], rtol=1e-5, atol=atol)


def _padded_batch_rank(
    packed: bool, mtp_depth: int
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    return padded_slices_rank(
        "deepseek_v4",
        {"mtp_depth": mtp_depth},
        packed,
        lambda model, metrics: {"aux": model.aux_loss().detach()},
    )
