"""DeepSeek V3 with multi-token prediction trains under expert parallelism as one process does.

The debug recipe with one MTP depth (``deepseek_v3_debug_mtp``), fp32, random init, 3 steps
of 8 sequences of 32 tokens. EP 2 over two ranks (which also shards every other weight by
FSDP 2, the draft depth's included, and routes the depth's MoE by all-to-all) gives every
step's loss (main + weighted draft loss), gradient norm, draft loss and draft accuracy of one
process training the same 8 sequences as one micro-batch.

Under sequence parallelism (Ulysses SP 2) and context parallelism (CP 2) a depth's next
tokens and targets near the end of a rank's tokens sit on another rank: on packed rows whose
documents cross the slices, the loss (main + weighted draft loss), the draft's loss and
accuracy and every gradient equal one process's.
"""

from __future__ import annotations

from typing import Any

import pytest
from harness import run_on_ranks
from training import (
    Layout,
    assert_same_logits_loss_and_grads,
    assert_same_metrics,
    families_against_one_process,
    parity_config,
)
from training import train as train_layout

from temper.recipes.deepseek_v3 import deepseek_v3_debug_mtp

SINGLE8 = Layout("single8", world=1, local_batch=8)
EP2 = Layout("ep2", world=2, local_batch=4, parallelism={"ep": 2})


def test_expert_parallel_with_mtp_trains_like_one_process(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    folder = tmp_path_factory.getbasetemp() / "mtp"
    runs = {}
    for layout in (SINGLE8, EP2):
        config = parity_config(deepseek_v3_debug_mtp, folder, layout)
        config.training.seq_len = 32
        runs[layout.name] = train_layout(config, layout)
    run, reference = runs["ep2"], runs["single8"]
    assert "mtp.0.block.feed_forward.experts" in run.fsdp_units
    assert_same_metrics(run.rows, reference.rows)
    for row, ref in zip(run.rows, reference.rows, strict=True):
        assert row["mtp_loss"] == pytest.approx(ref["mtp_loss"], rel=1e-5)
        assert row["mtp_accuracy"] == pytest.approx(ref["mtp_accuracy"], abs=1e-6)
    # The draft learns: its loss falls over the run.
    assert run.rows[-1]["mtp_loss"] < run.rows[0]["mtp_loss"]


@pytest.mark.parametrize("layout", ["sp", "cp"])
def test_mtp_on_sequence_slices_gives_one_process_loss_and_gradients(layout: str) -> None:
    """deepseek_v3 debug with one MTP depth at SP 2 or CP 2 on two packed rows of 21 tokens
    (documents of 5, 9 and 7; SP's slices end at 11, CP's 6-token chunks at 6, 12 and 18):
    the real tokens' logits, the loss with the weighted draft loss, the draft's loss and
    accuracy (whole-sequence metrics) and every gradient (summed over the ranks, the depth's
    included) within 1e-5 of one process on the whole rows."""
    ((got, want),) = run_on_ranks(_mtp_rank, 2, layout)[0]
    assert_same_logits_loss_and_grads("deepseek_v3 mtp", got, want)
    for name in ("mtp_loss", "mtp_accuracy"):
        assert got["metrics"][name] == pytest.approx(want["metrics"][name], rel=1e-5), name
    assert want["grads"]["mtp.0.eh_proj.weight"].abs().max() > 0


def _mtp_rank(layout: str) -> list[tuple[dict[str, Any], dict[str, Any]]] | None:
    import torch.distributed as dist

    from temper.models.layers.whole_sequence import gather_sequence
    from temper.parallel import context_parallel
    from temper.parallel.ulysses import SequenceParallel
    from temper.utils.device import init_runtime

    init_runtime()
    group = dist.group.WORLD
    if layout == "sp":
        parallel: Any = SequenceParallel(group)
        gather = gather_sequence
    else:
        parallel = context_parallel.ContextParallel(group)
        gather = context_parallel.gather_sequence
    return families_against_one_process(
        parallel, ("deepseek_v3",), (5, 9, 7), lambda x: gather(x, group), {"mtp_depth": 1}
    )
