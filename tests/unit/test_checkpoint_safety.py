"""Loading a checkpoint never runs its code nor reads outside its folder, finds a lost,
truncated or altered file (every byte, by SHA-256), and `resume auto` passes over such a
checkpoint to the one before; a full disk during a save is one line and loses nothing."""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import pickle
import re
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.state_dict import get_model_state_dict

import temper.checkpoint.integrity as integrity
from temper.checkpoint.adapter import read_peft_adapter
from temper.checkpoint.convert import main
from temper.checkpoint.integrity import (
    IncompleteCheckpoint,
    file_records,
    listed_files,
    manifest_text,
    read_manifest,
)
from temper.checkpoint.manager import (
    CheckpointManager,
    CheckpointWarning,
    DiskFull,
    remove_partial_saves,
    resolve_resume,
)
from temper.checkpoint.metadata import build_metadata, run_structure
from temper.checkpoint.reader import UnsafeCheckpoint, read_dcp_metadata
from temper.config import ConfigError, load_config
from temper.engine.checkpointing import load_model_weights
from temper.models import build_model
from temper.utils.paths import UnsafePath

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


def rewrite_manifest(folder: Path) -> None:
    """What an attacker who edits a checkpoint does too: a manifest that matches the edit."""
    records = file_records(folder, listed_files(folder))
    (folder / "manifest.json").write_text(manifest_text(records))


def load_into_fresh_model(manager: CheckpointManager, step: int) -> torch.nn.Module:
    model = tiny_model(1)
    manager.load(step, {"model": get_model_state_dict(model)})
    return model


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
    rewrite_manifest(folder)

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
    rewrite_manifest(folder)
    with pytest.raises(IncompleteCheckpoint, match=rf"{folder}/\.metadata: not a readable DCP"):
        manager.load(3, {"model": get_model_state_dict(tiny_model(1))})


def craft_bytes_entry(folder: Path, key: str, payload: object) -> None:
    """Declare `key` a DCP bytes entry whose bytes are a ``torch.save`` of `payload`: DCP's
    default planner would read it with ``torch.load(weights_only=False)``."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    (folder / "payload.pt").write_bytes(buffer.getvalue())
    metadata = read_dcp_metadata(folder)
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data = {
        index: info for index, info in metadata.storage_data.items() if index.fqn != key
    }
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo(
        "payload.pt", 0, len(buffer.getvalue())
    )
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    rewrite_manifest(folder)


def test_a_bytes_entry_is_refused_on_every_load_path(tmp_path: Path, capsys) -> None:
    manager = saved(tmp_path / "ckpt")
    folder = tmp_path / "ckpt" / "step-3"
    marker = tmp_path / "payload-ran"
    craft_bytes_entry(folder, "model.output.weight", RunsACommand(marker))
    # The reference: DCP's own reader and planner run the payload.
    dcp.load({"model.output.weight": torch.empty(64, 32)}, storage_reader=FileSystemReader(folder))
    assert marker.exists()
    marker.unlink()

    refused = rf"{folder}/\.metadata: entry 'model\.output\.weight' is a BytesStorageMetadata"
    with pytest.raises(UnsafeCheckpoint, match=refused):  # resume auto: refused, not skipped
        resolve_resume(tmp_path / "ckpt", "auto")
    with pytest.raises(UnsafeCheckpoint, match=refused):  # resume
        manager.load(3, {"model": get_model_state_dict(tiny_model(1))})
    with pytest.raises(UnsafeCheckpoint, match=refused):  # checkpoint.initial_load
        load_model_weights(tiny_model(1), folder)
    code = main(["dcp-to-hf", "--checkpoint", str(folder), "--output", str(tmp_path / "hf")])
    assert code == 2 and "is a BytesStorageMetadata" in capsys.readouterr().err
    assert not marker.exists()


@pytest.mark.parametrize("path", ["/etc/passwd", "../outside.distcp"])
def test_a_storage_path_leading_out_is_refused(tmp_path: Path, path: str) -> None:
    manager = saved(tmp_path / "ckpt")
    folder = tmp_path / "ckpt" / "step-3"
    metadata = read_dcp_metadata(folder)
    index = next(i for i in metadata.storage_data if i.fqn == "model.output.weight")
    info = metadata.storage_data[index]
    shutil_copy = (folder / info.relative_path).read_bytes()
    (tmp_path / "ckpt" / "outside.distcp").write_bytes(shutil_copy)  # a readable target
    metadata.storage_data[index] = _StorageInfo(path, info.offset, info.length)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    rewrite_manifest(folder)
    with pytest.raises(UnsafeCheckpoint, match=rf"entry 'model\.output\.weight': .*{path}"):
        manager.load(3, {"model": get_model_state_dict(tiny_model(1))})


def test_a_symlink_in_a_checkpoint_is_refused_and_never_exported(tmp_path: Path, capsys) -> None:
    """The attack of the issue: a symlinked tokenizer file pointing at a secret."""
    secret = tmp_path / "secret.txt"
    secret.write_text("the secret")
    saved(tmp_path / "ckpt")
    folder = tmp_path / "ckpt" / "step-3"
    (folder / "tokenizer").mkdir()
    (folder / "tokenizer" / "special_tokens_map.json").symlink_to(secret)
    with pytest.raises(UnsafePath, match=r"tokenizer/special_tokens_map\.json: a symlink"):
        resolve_resume(tmp_path / "ckpt", "auto")
    out = tmp_path / "hf"
    code = main(["dcp-to-hf", "--checkpoint", str(folder), "--output", str(out)])
    assert code == 2 and "special_tokens_map.json: a symlink" in capsys.readouterr().err
    exported = [p.read_bytes() for p in out.rglob("*") if p.is_file()] if out.exists() else []
    assert all(b"the secret" not in data for data in exported)


def test_the_manifest_holds_each_files_digest(tmp_path: Path) -> None:
    """By hand: SHA-256 over the SHA-256 of each 64 MiB piece (one piece for these)."""
    saved(tmp_path)
    folder = tmp_path / "step-3"
    records = read_manifest(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert sorted(records) == [p.relative_to(folder).as_posix() for p in files]
    for path in files:
        record = records[path.relative_to(folder).as_posix()]
        piece = hashlib.sha256(path.read_bytes()).digest()
        assert record == {"size": path.stat().st_size, "digest": hashlib.sha256(piece).hexdigest()}


def flip_one_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("target", ["shard", "metadata"])
def test_a_flipped_byte_is_caught_and_auto_resume_falls_back(tmp_path: Path, target: str) -> None:
    manager = saved(tmp_path, steps=(4, 8))
    folder = tmp_path / "step-8"
    path = next(folder.glob("*.distcp")) if target == "shard" else folder / ".metadata"
    flip_one_byte(path, path.stat().st_size // 2)
    message = rf"{path}: its SHA-256 digest differs from the one the save recorded"
    with pytest.raises(IncompleteCheckpoint, match=message):
        manager.load(8, {"model": get_model_state_dict(tiny_model(1))})
    with pytest.raises(IncompleteCheckpoint, match=message):
        resolve_resume(tmp_path, "8")
    with pytest.warns(CheckpointWarning, match=message + r".*resuming from the checkpoint before"):
        assert resolve_resume(tmp_path, "auto") == 4
    assert torch.equal(load_into_fresh_model(manager, 4).output.weight, tiny_model(0).output.weight)


def test_an_unreadable_metadata_falls_back_even_when_its_digest_matches(tmp_path: Path) -> None:
    saved(tmp_path, steps=(4, 8))
    folder = tmp_path / "step-8"
    (folder / ".metadata").write_bytes(b"\x80\x04\x95" + b"\xff" * 64)  # a lying frame length
    rewrite_manifest(folder)
    with pytest.warns(CheckpointWarning, match=r"\.metadata: not a readable DCP metadata file"):
        assert resolve_resume(tmp_path, "auto") == 4


def test_a_file_the_save_did_not_write_is_named(tmp_path: Path) -> None:
    manager = saved(tmp_path)
    (tmp_path / "step-3" / "extra.distcp").write_bytes(b"added later")
    with pytest.raises(IncompleteCheckpoint, match=r"extra\.distcp: not written by the save"):
        manager.load(3, {"model": get_model_state_dict(tiny_model(1))})


def test_a_checkpoint_of_the_first_manifest_format_still_loads(tmp_path: Path) -> None:
    """Sizes only (no digests), as saves wrote before: its sizes are still checked."""
    manager = saved(tmp_path)
    folder = tmp_path / "step-3"
    records = read_manifest(folder)
    sizes = {name: record["size"] for name, record in records.items()}
    (folder / "manifest.json").write_text(json_dumps({"files": sizes}))
    assert torch.equal(load_into_fresh_model(manager, 3).output.weight, tiny_model(0).output.weight)
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(IncompleteCheckpoint, match=r"10 bytes, the checkpoint wrote"):
        manager.load(3, {"model": get_model_state_dict(tiny_model(1))})


def json_dumps(value: object) -> str:
    import json

    return json.dumps(value)


def test_an_export_is_verified_and_carries_checksums_and_plain_modes(tmp_path: Path) -> None:
    saved(tmp_path / "ckpt")
    folder = tmp_path / "ckpt" / "step-3"
    out = tmp_path / "hf"
    assert main(["dcp-to-hf", "--checkpoint", str(folder), "--output", str(out)]) == 0
    listed = (out / "checksums.sha256").read_text().splitlines()
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "checksums.sha256")
    assert len(listed) == len(files) and any("model.safetensors" in line for line in listed)
    checked = subprocess.run(
        ["sha256sum", "-c", "checksums.sha256"], cwd=out, capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    mask = os.umask(0)
    os.umask(mask)
    assert {oct(p.stat().st_mode & 0o777) for p in out.rglob("*") if p.is_file()} == {
        oct(0o666 & ~mask)
    }
    flip_one_byte(next(folder.glob("*.distcp")), 40)
    assert main(["dcp-to-hf", "--checkpoint", str(folder), "--output", str(tmp_path / "b")]) == 2


@pytest.fixture
def small_filesystem(tmp_path: Path):
    """A 2 MiB tmpfs (root only: skipped where mounting is not allowed)."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_real_full_disk_during_a_save(small_filesystem: Path) -> None:
    root = small_filesystem / "checkpoints"
    manager = saved(root, steps=(4,))
    model = tiny_model()
    state = {"model": get_model_state_dict(model), "big": torch.zeros(1 << 20)}  # 4 MiB
    with pytest.raises(DiskFull, match=r"\.step-8\.partial: no space left on device .*step-4"):
        manager.save(8, state, build_metadata(model, step=8, structure=STRUCTURE))
    assert sorted(p.name for p in root.iterdir()) == ["step-4"]
    assert resolve_resume(root, "auto") == 4
    assert torch.equal(load_into_fresh_model(manager, 4).output.weight, tiny_model(0).output.weight)


def test_an_initial_adapter_linking_out_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.safetensors"
    elsewhere.write_bytes(b"not the adapter's")
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8}')
    (folder / "adapter_model.safetensors").symlink_to(elsewhere)
    with pytest.raises(UnsafePath, match=rf"adapter_model\.safetensors: resolves to {elsewhere}"):
        read_peft_adapter(tiny_model(), folder, rank=4, alpha=8, rslora=False)


def test_the_pre_flight_refuses_a_crafted_initial_load_in_one_line(tmp_path: Path, capsys) -> None:
    """Exit 2 before any rank starts, naming the file and the entry."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from temper.checkpoint.convert import hf_to_dcp
    from temper.train import main as train

    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    hf_to_dcp(tmp_path / "hf", tmp_path / "ckpt")
    marker = tmp_path / "payload-ran"
    craft_bytes_entry(tmp_path / "ckpt", "model.norm.weight", RunsACommand(marker))
    capsys.readouterr()
    code = train(
        [
            "--check_only",
            "--checkpoint.initial_load",
            str(tmp_path / "ckpt"),
            "--job.dump_folder",
            str(tmp_path / "run"),
        ]
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("temper: config error: checkpoint: ")
    assert f"{tmp_path / 'ckpt'}/.metadata: entry 'model.norm.weight' is a Bytes" in lines[0]
    assert not marker.exists()


def test_the_digest_of_a_file_of_several_pieces(tmp_path: Path, monkeypatch) -> None:
    """By hand, with pieces of 1 KiB: a flip in any piece changes the digest."""
    monkeypatch.setattr(integrity, "PIECE", 1024)
    path = tmp_path / "f"
    data = os.urandom(3 * 1024 + 100)
    path.write_bytes(data)
    pieces = [hashlib.sha256(data[i : i + 1024]).digest() for i in range(0, len(data), 1024)]
    assert len(pieces) == 4
    assert integrity.digest_of(path) == hashlib.sha256(b"".join(pieces)).hexdigest()
    flip_one_byte(path, 2 * 1024 + 5)
    assert integrity.digest_of(path) != hashlib.sha256(b"".join(pieces)).hexdigest()


def test_a_run_whose_disk_fills_ends_in_one_line_with_its_metrics(
    small_filesystem: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run's checkpoints on a 2 MiB tmpfs: the first save does not fit. Exit 1, one line
    naming the folder, and the step that trained is in metrics.jsonl."""
    from temper.train import main as train

    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(small_filesystem)
    args = ["--training.steps", "1", "--training.seq_len", "16", "--metrics.no-tensorboard"]
    args += ["--checkpoint.enable", "--checkpoint.interval", "1", "--job.dump_folder", str(run)]
    assert train(args) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and re.fullmatch(
        r"temper: .*\.step-1\.partial: no space left on device while saving step-1; the "
        r"partial save was removed and there is no earlier checkpoint",
        lines[0],
    ), lines
    (record,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 1 and math.isfinite(record["loss"])
    assert list(small_filesystem.iterdir()) == []
