"""DeepSeek sparse attention trains under FSDP and expert parallelism as one process does.

The DSA debug recipes (``deepseek_v32_debug``, ``glm_moe_dsa_debug``: indexers trained by
their KL term, ``indexer_training`` sparse), fp32, random init, 96-token rows so that each
query keeps 64 of up to 96 keys. EP 2 over two ranks (which also shards every other weight,
the indexers' included, by FSDP 2) gives every step's loss (with the weighted KL), gradient
norm and indexer KL of one process training the same 8 sequences as one micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from training import Layout, assert_same_metrics, parity_config
from training import train as train_layout

from temper.config import Config
from temper.recipes.deepseek_v32 import deepseek_v32_debug, glm_moe_dsa_debug

SINGLE8 = Layout("single8", world=1, local_batch=8)
EP2 = Layout("ep2", world=2, local_batch=4, parallelism={"ep": 2})


@pytest.mark.parametrize(
    "recipe",
    [deepseek_v32_debug, pytest.param(glm_moe_dsa_debug, marks=pytest.mark.slow)],
    ids=["deepseek_v32", "glm_moe_dsa"],
)
def test_expert_parallel_dsa_trains_like_one_process(
    recipe: Callable[[], Config], tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = tmp_path_factory.getbasetemp() / recipe.__name__
    runs = {}
    for layout in (SINGLE8, EP2):
        config = parity_config(recipe, folder, layout)
        config.training.seq_len = 96
        runs[layout.name] = train_layout(config, layout)
    run, reference = runs["ep2"], runs["single8"]
    assert "layers.1.feed_forward.experts" in run.fsdp_units
    assert_same_metrics(run.rows, reference.rows)
    for row, ref in zip(run.rows, reference.rows, strict=True):
        assert row["indexer_kl"] == pytest.approx(ref["indexer_kl"], rel=1e-5)
    # The indexers learn: their KL toward the main attention falls over the run.
    assert run.rows[-1]["indexer_kl"] < run.rows[0]["indexer_kl"]
