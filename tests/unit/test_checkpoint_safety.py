"""Loading a checkpoint never runs its code, finds a lost or truncated file, and `resume
auto` passes over such a checkpoint to the one before."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from temper.checkpoint.convert import main
from temper.checkpoint.integrity import IncompleteCheckpoint, manifest_text
from temper.checkpoint.manager import (
    CheckpointManager,
    CheckpointWarning,
    remove_partial_saves,
    resolve_resume,
)
from temper.checkpoint.metadata import build_metadata, run_structure
from temper.checkpoint.reader import UnsafeCheckpoint, read_dcp_metadata
from temper.config import ConfigError, load_config
from temper.engine.checkpointing import load_model_weights
from temper.models import build_model

TINY = {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden_dim": 64}
STRUCTURE = run_structure(ep=1, lora=None, param_dtype=torch.float32)


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("llama3", "debug", device="cpu", vocab_size=64, overrides=TINY)


def saved(root: Path, steps: tuple[int, ...] = (3,)) -> CheckpointManager:
    manager = CheckpointManager(root, keep_latest_k=0, async_mode=False)
    model = tiny_model()
    for step in steps:
        state = {"model": get_model_state_dict(model), "train": {"step": step}}
        manager.save(step, state, build_metadata(model, step=step, structure=STRUCTURE))
    return manager


class RunsACommand:
    """What an attacker pickles: unpickling it runs `touch <marker>`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


def test_a_crafted_metadata_is_refused_on_every_load_path(tmp_path: Path, capsys) -> None:
    manager = saved(tmp_path / "ckpt")
    folder = tmp_path / "ckpt" / "step-3"
    marker = tmp_path / "payload-ran"
    # A real DCP metadata with the payload tucked inside, and a manifest to match: the
    # integrity check passes, only the unpickler stands in the way.
    metadata = read_dcp_metadata(folder)
    metadata.planner_data = RunsACommand(marker)
    crafted = pickle.dumps(metadata)
    pickle.loads(crafted)  # the reference: plain pickle (what DCP's reader does) runs it
    assert marker.exists()
    marker.unlink()
    (folder / ".metadata").write_bytes(crafted)
    (folder / "manifest.json").write_text(manifest_text(folder))

    refused = rf"{folder}/\.metadata: refused to load posix\.system"
    with pytest.raises(UnsafeCheckpoint, match=refused):  # resume
        manager.load(3, {"model": get_model_state_dict(tiny_model(1))})
    with pytest.raises(UnsafeCheckpoint, match=refused):  # checkpoint.initial_load
        load_model_weights(tiny_model(1), folder)
    code = main(["dcp-to-hf", "--checkpoint", str(folder), "--output", str(tmp_path / "hf")])
    assert code == 2 and "refused to load posix.system" in capsys.readouterr().err
    assert not marker.exists()


def test_real_metadata_of_every_dtype_passes(tmp_path: Path) -> None:
    """What a save writes (bf16, fp16, ints, bools, scalars, non-contiguous) reads back."""
    tensors = {
        "bf16": torch.ones(3, dtype=torch.bfloat16),
        "fp16": torch.ones(2, dtype=torch.float16),
        "int": torch.arange(4),
        "bool": torch.ones(2, dtype=torch.bool),
        "scalar": torch.tensor(1.5),
        "transposed": torch.arange(6.0).view(2, 3).t(),
    }
    manager = CheckpointManager(tmp_path, keep_latest_k=0, async_mode=False)
    manager.save(1, {"t": tensors}, {"format": 1})
    back = {"t": {k: torch.zeros_like(v) for k, v in tensors.items()}}
    manager.load(1, back)
    for name, tensor in tensors.items():
        assert torch.equal(back["t"][name], tensor), name


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_shard_is_named_and_auto_resume_falls_back(tmp_path: Path, damage: str) -> None:
    manager = saved(tmp_path, steps=(4, 8))
    shard = next((tmp_path / "step-8").glob("*.distcp"))
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:100])
        message = rf"{shard}: 100 bytes, the checkpoint wrote \d+ \(truncated"
    else:
        shard.unlink()
        message = rf"{shard}: missing"
    with pytest.raises(IncompleteCheckpoint, match=message):
        manager.load(8, {"model": get_model_state_dict(tiny_model(1))})
    with pytest.raises(IncompleteCheckpoint, match=message):
        resolve_resume(tmp_path, "8")
    with pytest.warns(CheckpointWarning, match=message + r".*resuming from the checkpoint before"):
        assert resolve_resume(tmp_path, "auto") == 4
    other = tiny_model(1)
    manager.load(4, {"model": get_model_state_dict(other)})
    assert torch.equal(other.output.weight, tiny_model(0).output.weight)


def test_partial_saves_are_removed_with_a_warning(tmp_path: Path) -> None:
    saved(tmp_path, steps=(4,))
    (tmp_path / ".step-8.partial").mkdir()
    (tmp_path / ".step-8.partial" / "__0_0.distcp").write_bytes(b"half")
    with pytest.warns(CheckpointWarning, match=r"\.step-8\.partial: removed the partial save"):
        remove_partial_saves(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4"]


@pytest.mark.parametrize(
    "flag",
    [
        ["--checkpoint.interval", "100"],
        ["--checkpoint.keep_latest_k", "2"],
        ["--checkpoint.async_mode"],
        ["--checkpoint.resume", "never"],
    ],
)
def test_a_checkpoint_flag_without_enable_is_refused(flag: list[str]) -> None:
    name = flag[0].removeprefix("--")
    with pytest.raises(ConfigError, match=rf"{name} .* without --checkpoint.enable"):
        load_config("temper.recipes.llama3", "llama3_debug", flag)
    load_config("temper.recipes.llama3", "llama3_debug", [*flag, "--checkpoint.enable"])


def test_a_garbled_metadata_is_named(tmp_path: Path) -> None:
    """Half a `.metadata` (its manifest rewritten to match) is refused naming the file."""
    manager = saved(tmp_path)
    folder = tmp_path / "step-3"
    data = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(data[: len(data) // 2])
    (folder / "manifest.json").write_text(manifest_text(folder))
    with pytest.raises(UnsafeCheckpoint, match=rf"{folder}/\.metadata: not a readable DCP"):
        manager.load(3, {"model": get_model_state_dict(tiny_model(1))})
