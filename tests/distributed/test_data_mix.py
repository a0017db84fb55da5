"""A parquet SFT set and a JSONL SFT set mixed 3:1 by weight, validated every 2 steps on a
held-out tenth, saved by 2 data-parallel ranks and resumed by one process: the losses, the
validation losses, the per-source counts and the data position are those of one process
training straight through, so no document was lost or seen twice."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_resume import run

from temper.config import Config, DataSource, Validation
from temper.data.tasks import sft_conversations
from temper.recipes.posttrain import sft_debug

pytestmark = pytest.mark.slow

STEPS, CRASH_AFTER, GLOBAL_BATCH = 4, 2, 4


def _write_sets(folder: Path) -> tuple[Path, Path]:
    """60 conversations as parquet under the column "conversation", 40 others as JSONL."""
    parquet, jsonl = folder / "chat.parquet", folder / "chat.jsonl"
    pq.write_table(pa.table({"conversation": sft_conversations(1, "train", 60)}), parquet)
    lines = (json.dumps({"messages": c}) + "\n" for c in sft_conversations(2, "train", 40))
    jsonl.write_text("".join(lines))
    return parquet, jsonl


def mix_config(folder: Path, sets: tuple[Path, Path], world: int) -> Config:
    config = sft_debug()
    config.job.dump_folder = str(folder)
    config.training.steps = STEPS
    config.training.seq_len = 48
    config.training.local_batch_size = GLOBAL_BATCH // world
    config.training.global_batch_size = GLOBAL_BATCH
    config.training.deterministic = True
    config.metrics.tensorboard = False
    config.checkpoint.enable = True
    config.checkpoint.interval = CRASH_AFTER
    parquet, jsonl = sets
    config.data.sources = [
        DataSource(str(parquet), weight=3.0, fields={"messages": "conversation"}),
        DataSource(str(jsonl), weight=1.0),
    ]
    config.validation = Validation(interval=2, fraction=0.1, steps=1)
    return config


def test_mixed_sft_with_validation_resumes_at_another_data_parallel_size(tmp_path: Path) -> None:
    sets = _write_sets(tmp_path)
    straight = run(mix_config(tmp_path / "straight", sets, 1), 1)
    run(mix_config(tmp_path / "run", sets, 2), 2, crash_after=CRASH_AFTER)
    resumed = run(mix_config(tmp_path / "run", sets, 1), 1)
    assert resumed["resumed_from"] == CRASH_AFTER
    rows, reference = resumed["rows"], straight["rows"]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in reference], rel=1e-5)
    validated = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    expected = [(r["step"], r["val_loss"]) for r in reference if "val_loss" in r]
    assert [s for s, _ in validated] == [2, 4]
    assert validated == [(s, pytest.approx(v, rel=1e-5)) for s, v in expected]
    counts = {k: v for k, v in rows[-1].items() if k.startswith("data_chat")}
    assert sorted(counts) == [f"data_chat_{i}_{k}" for i in (0, 1) for k in ("documents", "tokens")]
    assert counts == {k: reference[-1][k] for k in counts}
    assert resumed["data"] == straight["data"]  # every lane where the straight run left it
