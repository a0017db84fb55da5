"""DeepSeek V3 with multi-token prediction trains under expert parallelism as one process does.

The debug recipe with one MTP depth (``deepseek_v3_debug_mtp``), fp32, random init, 5 steps
of 8 sequences of 32 tokens. EP 2 over two ranks (which also shards every other weight by
FSDP 2, the draft depth's included, and routes the depth's MoE by all-to-all) gives every
step's loss (main + weighted draft loss), gradient norm, draft loss and draft accuracy of one
process training the same 8 sequences as one micro-batch.
"""

from __future__ import annotations

import pytest
from training import Layout, assert_same_metrics, parity_config
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
