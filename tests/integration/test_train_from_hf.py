"""Training starts from an HF folder's weights and tokenizer (`--model.hf_path`)."""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_run_train import read_metrics, run_train
from transformers import LlamaConfig, LlamaForCausalLM

from temper.data import build_text_loader, load_tokenizer


def make_hf_folder(folder: Path, vocab_size: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    shutil.copy(resources.files("temper.assets") / "tokenizer.json", folder / "tokenizer.json")
    return model.eval()


def test_first_loss_is_the_hf_models_loss(tmp_path: Path) -> None:
    hf = make_hf_folder(tmp_path / "hf", vocab_size=768)
    dump = tmp_path / "run"
    result = run_train(
        [
            "--model.hf_path", str(tmp_path / "hf"),
            "--training.steps", "4",
            "--training.seq_len", "64",
            "--training.local_batch_size", "2",
            "--job.dump_folder", str(dump),
        ],
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    # The same first batch through the HF model: its loss is the run's step-1 loss.
    tokenizer = load_tokenizer(str(tmp_path / "hf"))
    batch = next(iter(build_text_loader(tokenizer, seq_len=64, batch_size=2)))
    with torch.no_grad():
        logits = hf(batch["input_ids"]).logits
    expected = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item()
    rows = read_metrics(dump)
    assert rows[0]["loss"] == pytest.approx(expected, rel=1e-5)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert json.loads((dump / "config.json").read_text())["model"]["hf_path"] == str(
        tmp_path / "hf"
    )


def test_tokenizer_larger_than_the_embedding_is_refused(tmp_path: Path) -> None:
    make_hf_folder(tmp_path / "hf", vocab_size=256)
    result = run_train(
        ["--model.hf_path", str(tmp_path / "hf"), "--job.dump_folder", str(tmp_path / "run")],
        cwd=tmp_path,
    )
    assert result.returncode != 0
    assert "the tokenizer has 688 tokens but the model" in result.stderr
    assert "embeds only 256" in result.stderr
