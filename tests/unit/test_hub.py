"""``--model.hf_path owner/name``: the repository's snapshot in a local Hugging Face cache (a
fake one in tmp, laid out as huggingface_hub lays it out); never the network in tests."""

from __future__ import annotations

import hashlib
import shutil
from importlib import resources
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import constants
from huggingface_hub.errors import LocalEntryNotFoundError
from transformers import LlamaConfig, LlamaForCausalLM

from temper.config import ConfigError, load_config
from temper.train import main

REVISION = "0123456789abcdef0123456789abcdef01234567"


def tiny_model(folder: Path) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=768,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    shutil.copy(resources.files("temper.assets") / "tokenizer.json", folder / "tokenizer.json")
    return folder


def cache_repo(cache: Path, repo_id: str, source: Path) -> Path:
    """``source``'s files as huggingface_hub caches them: content in ``blobs/<sha256>``, the
    snapshot's names links to them, ``refs/main`` naming the revision. Returns the snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    snapshot.mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    for path in source.iterdir():
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copy(path, repo / "blobs" / digest)
        (snapshot / path.name).symlink_to(Path("..", "..", "blobs", digest))
    return snapshot


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "hub"
    folder.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a lookup that tried the network would fail
    return folder


def test_a_repository_id_names_its_cached_snapshot(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snapshot = cache_repo(cache, "org/tiny", tiny_model(tmp_path / "src"))
    run = ["--model.hf_path", "org/tiny", "--job.dump_folder", str(tmp_path / "run")]
    config = load_config("temper.recipes.llama3", "llama3_debug", run)
    assert Path(config.model.hf_path) == snapshot
    assert main(["--check_only", *run]) == 0, capsys.readouterr().err  # weights, tokenizer


def test_an_uncached_id_is_refused_without_the_network(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    real = huggingface_hub.snapshot_download

    def recorded(*args: object, **kwargs: object) -> str:
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recorded)
    with pytest.raises(ConfigError) as error:
        load_config("temper.recipes.llama3", "llama3_debug", ["--model.hf_path", "Qwen/Qwen3-8B"])
    assert str(error.value) == (
        "model.hf_path Qwen/Qwen3-8B: no such folder, and the repository is not in the Hugging "
        f"Face cache ({cache}); --model.allow_download downloads it, or `hf download "
        "Qwen/Qwen3-8B` first"
    )
    assert calls == [{"local_files_only": True}]


def test_allow_download_fetches_into_the_cache(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``--model.allow_download`` an uncached id is fetched (here by a stand-in for the
    hub that fills the cache as a download would), model files only."""
    source = tiny_model(tmp_path / "src")
    fetched = []

    def hub(repo_id: str, local_files_only: bool = False, **kwargs: object) -> str:
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        fetched.append((repo_id, kwargs))
        return str(cache_repo(cache, repo_id, source))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    args = ["--model.hf_path", "org/tiny", "--model.allow_download"]
    config = load_config("temper.recipes.llama3", "llama3_debug", args)
    assert config.model.hf_path == str(cache / "models--org--tiny" / "snapshots" / REVISION)
    assert fetched == [
        ("org/tiny", {"allow_patterns": ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"]})
    ]


def test_a_snapshot_link_leading_out_of_its_repository_is_refused(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snapshot = cache_repo(cache, "org/tiny", tiny_model(tmp_path / "src"))
    outside = tmp_path / "outside.json"
    shutil.copy(snapshot / "tokenizer.json", outside)
    (snapshot / "tokenizer.json").unlink()
    (snapshot / "tokenizer.json").symlink_to(outside)
    run = ["--model.hf_path", "org/tiny", "--job.dump_folder", str(tmp_path / "run")]
    assert main(["--check_only", *run]) == 2
    err = capsys.readouterr().err
    assert f"resolves to {outside}, outside {cache / 'models--org--tiny'}; refused" in err


def test_an_existing_folder_is_never_looked_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_hub(*args: object, **kwargs: object) -> str:
        raise AssertionError("an existing folder went to the hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    monkeypatch.chdir(tmp_path)
    tiny_model(tmp_path / "org" / "tiny")  # a relative path that reads like an id
    config = load_config("temper.recipes.llama3", "llama3_debug", ["--model.hf_path", "org/tiny"])
    assert config.model.hf_path == "org/tiny"
