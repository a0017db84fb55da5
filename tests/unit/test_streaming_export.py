"""`dcp-to-hf` streams: one tensor read from DCP at a time, never the whole model, and the
files it writes are byte for byte those of loading the model whole and saving it (the
converter before streaming: `load_checkpoint_model` + `save_hf`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from temper.checkpoint.convert import dcp_to_hf, hf_to_dcp, load_checkpoint_model
from temper.checkpoint.manager import write_checkpoint
from temper.checkpoint.metadata import build_metadata, run_structure
from temper.checkpoint.streaming import (
    checkpoint_meta_model,
    hf_tensor_plan,
    streamed_hf_tensors,
)
from temper.config import LoRA
from temper.models import build_model, load_hf, materialize, save_hf
from temper.models.hf import hf_module_names
from temper.models.lora import apply_lora, lora_modules
from temper.models.safetensors_io import write_safetensors_streaming

SMALL = {"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden_dim": 64}
MOE = {**SMALL, "head_dim": 16, "n_experts": 4, "top_k": 2, "moe_hidden_dim": 16}


def checkpoint(folder: Path, family: str, overrides: dict, lora: bool) -> Path:
    """A checkpoint of a random tiny model (LoRA adapters random too, so merging matters)."""
    torch.manual_seed(0)
    model = build_model(family, "debug", vocab_size=64, overrides=overrides)
    settings = None
    if lora:
        settings = dataclasses.asdict(LoRA(enable=True, rank=4, alpha=8.0))
        apply_lora(
            model, settings["target_modules"], rank=4, alpha=8.0, hf_names=hf_module_names(model)
        )
    materialize(model, "cpu")
    with torch.no_grad():
        for module in lora_modules(model):
            module.lora_b.normal_()
    structure = run_structure(ep=1, lora=settings, param_dtype=torch.float32)
    metadata = build_metadata(model, step=1, structure=structure)
    write_checkpoint(folder, {"model": get_model_state_dict(model)}, metadata)
    return folder


@pytest.mark.parametrize(
    ("family", "overrides", "lora", "dtype"),
    [
        ("llama3", SMALL, True, None),
        ("llama3", SMALL, True, torch.bfloat16),
        ("llama3", SMALL, False, torch.bfloat16),
        ("qwen3_moe", MOE, False, None),
    ],
    ids=["llama3-lora", "llama3-lora-bf16", "llama3-bf16", "qwen3_moe"],
)
def test_streamed_files_equal_the_whole_model_save(
    tmp_path: Path, family: str, overrides: dict, lora: bool, dtype: torch.dtype | None
) -> None:
    folder = checkpoint(tmp_path / "step-1", family, overrides, lora)
    shard_bytes = 20_000  # several shards
    whole = load_checkpoint_model(folder)
    if dtype is not None:
        whole = whole.to(dtype)
    save_hf(whole, tmp_path / "whole", max_shard_bytes=shard_bytes)
    model = checkpoint_meta_model(folder)
    plan = hf_tensor_plan(model, dtype)
    written = write_safetensors_streaming(
        tmp_path / "streamed", plan, streamed_hf_tensors(folder, model, dtype), shard_bytes
    )
    assert len(written) > 2
    names = sorted(p.name for p in (tmp_path / "whole").glob("model*"))
    assert sorted(p.name for p in (tmp_path / "streamed").glob("model*")) == names
    for name in names:
        assert (tmp_path / "streamed" / name).read_bytes() == (
            tmp_path / "whole" / name
        ).read_bytes(), name


def test_dcp_to_hf_never_builds_the_model(tmp_path: Path, monkeypatch) -> None:
    """No weight of the model is allocated: only one tensor at a time is."""
    folder = checkpoint(tmp_path / "step-1", "qwen3_moe", MOE, lora=False)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("dcp-to-hf materialized the whole model")

    monkeypatch.setattr("temper.checkpoint.convert.materialize", refuse)
    dcp_to_hf(folder, tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file()


@pytest.mark.parametrize(
    ("family", "overrides"),
    [("qwen3", {**SMALL, "head_dim": 16}), ("qwen3_moe", MOE)],
    ids=["qwen3-tied", "qwen3_moe"],
)
def test_hf_to_dcp_streams_the_weights_load_hf_reads(
    tmp_path: Path, family: str, overrides: dict, monkeypatch
) -> None:
    """Each tensor (tied embeddings under both names, stacked experts) read when DCP writes
    it: the checkpoint holds exactly what loading the folder whole gives."""
    torch.manual_seed(0)
    save_hf(
        build_model(family, "debug", device="cpu", vocab_size=64, overrides=overrides),
        tmp_path / "hf",
    )
    reference = load_hf(tmp_path / "hf")

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("hf-to-dcp loaded the whole model")

    monkeypatch.setattr("temper.checkpoint.convert.load_hf", refuse)
    monkeypatch.setattr("temper.checkpoint.convert.materialize", refuse)
    hf_to_dcp(tmp_path / "hf", tmp_path / "ckpt")
    monkeypatch.undo()
    loaded = load_checkpoint_model(tmp_path / "ckpt").state_dict()
    assert loaded.keys() == reference.state_dict().keys()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(loaded[name], tensor), name
