"""Resuming across EP degrees, after an asynchronous save, and after a kill during a save:
each resumed run continues the uninterrupted one (bitwise at its layout, 1e-5 at another),
at the same next data row (no sample seen twice or skipped)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from resuming import SAVED_AT, STEPS, results, resume_config, run

from temper.recipes.llama3 import llama3_debug
from temper.recipes.qwen3 import qwen3_moe_debug


@pytest.mark.parametrize(
    ("world", "ep"),
    [pytest.param(1, 1, marks=pytest.mark.slow), pytest.param(4, 2, marks=pytest.mark.slow)],
    ids=["ep1", "ep2_fsdp2"],
)
def test_moe_resumes_at_another_ep_degree(tmp_path: Path, world: int, ep: int) -> None:
    """Qwen3-MoE saved under EP 2 resumes in one process and under EP 2 x expert FSDP 2:
    DCP reshards the experts as it does FSDP shards."""
    straight = run(resume_config(qwen3_moe_debug, tmp_path / "straight", 1), 1)
    config = resume_config(qwen3_moe_debug, tmp_path / "run", 2, ep=2)
    crashed = run(config, 2, crash_after=SAVED_AT)
    assert crashed["ep"] == 2 and crashed["steps"] == list(range(1, SAVED_AT + 1))
    assert_streamed_export_is_exact(tmp_path / "run" / "checkpoints" / f"step-{SAVED_AT}")
    resumed = run(resume_config(qwen3_moe_debug, tmp_path / "run", world, ep=ep), world)
    assert resumed["resumed_from"] == SAVED_AT and resumed["ep"] == ep
    assert resumed["steps"] == list(range(1, STEPS + 1))
    assert resumed["losses"] == pytest.approx(straight["losses"], rel=1e-5)
    assert resumed["data"] == straight["data"]


def assert_streamed_export_is_exact(folder: Path) -> None:
    """The streaming converter reads EP-sharded experts into the files that loading the
    whole model (DCP resharding it into one process) and saving it writes."""
    from temper.checkpoint.convert import load_checkpoint_model
    from temper.checkpoint.streaming import (
        checkpoint_meta_model,
        hf_tensor_plan,
        streamed_hf_tensors,
    )
    from temper.models import save_hf
    from temper.models.safetensors_io import SINGLE_FILE, write_safetensors_streaming

    whole, streamed = folder.parents[2] / "whole", folder.parents[2] / "streamed"
    save_hf(load_checkpoint_model(folder), whole)
    model = checkpoint_meta_model(folder)
    tensors = streamed_hf_tensors(folder, model, None)
    write_safetensors_streaming(streamed, hf_tensor_plan(model, None), tensors)
    assert (streamed / SINGLE_FILE).read_bytes() == (whole / SINGLE_FILE).read_bytes()


def test_resume_after_an_async_save_is_bitwise(tmp_path: Path) -> None:
    """Saved asynchronously at step 4 while steps 5 and 6 trained on: the staged copy is
    step 4's state, and the resumed run equals the uninterrupted (synchronous) one."""
    straight = run(resume_config(llama3_debug, tmp_path / "straight", 2), 2)
    config = resume_config(llama3_debug, tmp_path / "run", 2)
    config.checkpoint.async_mode = True
    run(config, 2, crash_after=SAVED_AT + 2)
    resumed = run(config, 2)
    assert resumed["resumed_from"] == SAVED_AT
    assert resumed["losses"] == straight["losses"]
    assert resumed["data"] == straight["data"]


KILLED_DURING_SAVE = """
import os, signal, sys
import torch.distributed.checkpoint as dcp
from temper.config import load_config
from temper.trainer import Trainer

save = dcp.save

def killed_during_the_step_8_save(state, checkpoint_id):
    save(state, checkpoint_id=checkpoint_id)  # every shard written, not yet published
    if checkpoint_id.endswith(".step-8.partial"):
        os.kill(os.getpid(), signal.SIGKILL)

dcp.save = killed_during_the_step_8_save
Trainer(load_config("temper.recipes.llama3", "llama3_debug", sys.argv[1:])).train()
"""


@pytest.mark.slow
def test_a_kill_during_a_save_resumes_from_the_previous_one(tmp_path: Path) -> None:
    """SIGKILL while step 8 is being saved (its shards written, not yet renamed into place):
    the restarted run removes the partial save, resumes from step 4 and trains steps 5 to
    8 as the uninterrupted run did, bitwise."""
    from temper.config import load_config
    from temper.trainer import Trainer

    def flags(folder: Path) -> list[str]:
        return [
            *("--job.dump_folder", str(folder), "--training.steps", str(STEPS)),
            *("--training.seq_len", "32", "--training.local_batch_size", "4"),
            *("--training.global_batch_size", "4", "--training.deterministic"),
            *(
                "--metrics.no_tensorboard",
                "--checkpoint.enable",
                "--checkpoint.interval",
                str(SAVED_AT),
            ),
        ]

    def train(folder: Path) -> dict:
        config = load_config("temper.recipes.llama3", "llama3_debug", flags(folder))
        Trainer(config).train()
        return results(config)

    straight = train(tmp_path / "straight")
    root = Path(__file__).resolve().parents[2]
    process = subprocess.run(
        [sys.executable, "-c", KILLED_DURING_SAVE, *flags(tmp_path / "run")],
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert process.returncode == -9, process.stderr
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [".step-8.partial", "step-4"]
    with pytest.warns(UserWarning, match=r"\.step-8\.partial: removed the partial save"):
        resumed = train(tmp_path / "run")
    assert resumed["steps"] == list(range(1, STEPS + 1))
    assert resumed["losses"] == straight["losses"]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-4", "step-8"]
