"""Checkpoint files: the tensor/JSON split, atomic saves, pruning, resume choice, conversion."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from transformers import AutoModelForCausalLM

from temper.checkpoint import manager as manager_module
from temper.checkpoint.convert import (
    check_output,
    dcp_to_hf,
    hf_to_dcp,
    load_checkpoint_model,
    main,
)
from temper.checkpoint.manager import CheckpointManager, complete_steps, resolve_resume
from temper.checkpoint.metadata import build_metadata, run_structure, structure_differences
from temper.checkpoint.state import join_tensors, split_tensors
from temper.models import build_model, save_hf

STRUCTURE = run_structure(ep=1, lora=None, param_dtype=torch.float32)


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("llama3", "debug", device="cpu")


def test_split_and_join_round_trip() -> None:
    state = {
        "a": torch.arange(3),
        "nested": {"lr": 1e-3, "betas": (0.9, 0.95), "ids": [1, 2], "t": torch.ones(2)},
        "by_index": {0: {"x": torch.zeros(1)}, "name": None},
    }
    tensors, skeleton = split_tensors(state)
    assert sorted(tensors) == ["a", "by_index.0.x", "nested.t"]
    import json

    back = join_tensors(json.loads(json.dumps(skeleton)), tensors)
    assert back["nested"]["betas"] == [0.9, 0.95] and back["nested"]["ids"] == [1, 2]
    assert back["by_index"][0]["x"] is tensors["by_index.0.x"] and back["by_index"]["name"] is None
    with pytest.raises(TypeError, match="nested.f: cannot checkpoint a function"):
        split_tensors({"nested": {"f": lambda: 0}})


def save_model(manager: CheckpointManager, model: torch.nn.Module, step: int) -> None:
    state = {"model": get_model_state_dict(model), "train": {"step": step}}
    manager.save(step, state, build_metadata(model, step=step, structure=STRUCTURE))


def test_save_load_and_keep_latest(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_latest_k=2, async_mode=False)
    model = tiny_model(0)
    for step in (1, 2, 3):
        save_model(manager, model, step)
    assert complete_steps(tmp_path) == [2, 3]
    other = tiny_model(1)
    state = manager.load(3, {"model": get_model_state_dict(other), "train": {}})
    assert state["train"] == {"step": 3}
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_async_save_lands_after_wait(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_latest_k=0, async_mode=True)
    model = tiny_model(0)
    save_model(manager, model, 5)
    with torch.no_grad():  # training goes on: the staged copy must not see this
        for p in model.parameters():
            p.add_(1.0)
    manager.wait()
    assert complete_steps(tmp_path) == [5]
    other = tiny_model(1)
    manager.load(5, {"model": get_model_state_dict(other)})
    assert torch.equal(other.norm.weight, torch.ones_like(other.norm.weight))


def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    manager = CheckpointManager(tmp_path, keep_latest_k=1, async_mode=False)
    model = tiny_model(0)
    save_model(manager, model, 4)

    def dies_midway(tensors, checkpoint_id):
        Path(checkpoint_id, "__0_0.distcp").write_bytes(b"half a shard")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(manager_module.dcp, "save", dies_midway)
    with pytest.raises(OSError, match="no space left on device while saving step-8"):
        save_model(manager, model, 8)
    assert complete_steps(tmp_path) == [4]  # the partial folder is not a checkpoint
    assert resolve_resume(tmp_path, "auto") == 4
    monkeypatch.undo()
    other = tiny_model(1)
    manager.load(4, {"model": get_model_state_dict(other)})
    assert torch.equal(other.output.weight, model.output.weight)
    save_model(manager, model, 8)  # the next save clears the partial folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-8"]


def test_resolve_resume(tmp_path: Path) -> None:
    assert resolve_resume(tmp_path, "auto") is None
    manager = CheckpointManager(tmp_path, keep_latest_k=0, async_mode=False)
    for step in (2, 6):
        save_model(manager, tiny_model(), step)
    assert resolve_resume(tmp_path, "auto") == 6
    assert resolve_resume(tmp_path, "2") == 2
    assert resolve_resume(tmp_path, "never") is None
    with pytest.raises(FileNotFoundError, match=r"resume 3: .*complete steps there: \[2, 6\]"):
        resolve_resume(tmp_path, "3")


def test_structure_differences_are_named() -> None:
    model = tiny_model()
    saved = build_metadata(model, step=1, structure=STRUCTURE)
    current = build_metadata(model, step=1, structure=run_structure(2, None, torch.bfloat16))
    current["model"]["args"]["n_layers"] = 6
    assert structure_differences(saved, current) == [  # the EP degree is a layout: it may differ
        "model.args.n_layers: checkpoint 4, config 6",
        "structure.param_dtype: checkpoint 'float32', config 'bfloat16'",
    ]


def test_metadata_builds_from_a_checkout_that_is_not_installed(monkeypatch) -> None:
    """Run from PYTHONPATH (a machine with no package index), `temper` has no package
    metadata: the checkpoint still saves, saying so, as it did not on the GPU check."""
    from importlib.metadata import PackageNotFoundError

    from temper.checkpoint import metadata

    def missing(name: str) -> str:
        raise PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    built = build_metadata(tiny_model(), step=1, structure=STRUCTURE)
    assert built["versions"]["temper"] == "not installed"
    assert built["versions"]["torch"] == torch.__version__


def test_dcp_to_hf_loads_in_transformers(tmp_path: Path) -> None:
    model = tiny_model(0)
    manager = CheckpointManager(tmp_path / "ckpt", keep_latest_k=0, async_mode=False)
    save_model(manager, model, 3)
    dcp_to_hf(tmp_path / "ckpt" / "step-3", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 600, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=1e-5, atol=1e-5)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.eos_token == "<|endoftext|>"


def test_hf_to_dcp_round_trip(tmp_path: Path) -> None:
    model = tiny_model(0)
    save_hf(model, tmp_path / "hf")
    hf_to_dcp(tmp_path / "hf", tmp_path / "ckpt")
    loaded = load_checkpoint_model(tmp_path / "ckpt")
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ("ckpt", "is the source folder"),
        (".", "contains the source folder"),
        ("ckpt/inner", "lies inside the source folder"),
        ("old", "already holds checkpoint state"),
    ],
)
def test_refused_outputs(tmp_path: Path, output: str, message: str, capsys) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "temper.json").write_text("{}")
    with pytest.raises(ValueError, match=message):
        check_output(tmp_path / output, [tmp_path / "ckpt"])
    save_model(CheckpointManager(tmp_path, keep_latest_k=0, async_mode=False), tiny_model(), 1)
    code = main(
        [
            "dcp-to-hf",
            "--checkpoint",
            str(tmp_path / "step-1"),
            "--output",
            str(tmp_path / "step-1"),
        ]
    )
    assert code == 2 and "is the source folder" in capsys.readouterr().err


SAVE_AND_LOAD = """
import sys, torch
from temper.checkpoint.manager import CheckpointManager, write_checkpoint
folder = sys.argv[1]
write_checkpoint(__import__("pathlib").Path(folder) / "step-1", {"w": torch.ones(3)}, {"format": 1})
manager = CheckpointManager(folder, keep_latest_k=0, async_mode=True)
manager.save(2, {"w": torch.ones(3)}, {"format": 1})
manager.wait()
loaded = {"w": torch.zeros(3)}
manager.load(2, loaded)
assert torch.equal(loaded["w"], torch.ones(3))
"""


def test_one_process_checkpoints_raise_no_warning(tmp_path) -> None:
    """Every warning an error (a process of its own: pytest resets filters per test): DCP
    alone warns in one process, Temper's sync and async saves and its load do not."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    command = [sys.executable, "-W", "error::UserWarning", "-c"]
    plain = "import torch, torch.distributed.checkpoint as dcp, sys\n"
    plain += "dcp.save({'w': torch.ones(3)}, checkpoint_id=sys.argv[1])"

    def run(code: str, folder: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*command, code, str(folder)], env=env, capture_output=True, text=True, timeout=300
        )

    assert "torch.distributed is disabled" in run(plain, tmp_path / "plain").stderr
    ours = run(SAVE_AND_LOAD, tmp_path)
    assert ours.returncode == 0, ours.stderr
