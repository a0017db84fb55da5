"""Pre-flight (`python -m temper.train --check_only`): each bad input fails before launch in
one line naming the flag, file and line, with exit code 2; a good config passes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from temper.checkpoint.convert import hf_to_dcp
from temper.data.tokenizer import builtin_tokenizer_path
from temper.train import main

ROOT = Path(__file__).resolve().parents[2]
SFT = ["--module", "temper.recipes.posttrain", "--config", "sft_debug"]


def check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    capsys.readouterr()  # drop what building the fixtures wrote (transformers' progress bars)
    code = main(["--check_only", *args])
    return code, capsys.readouterr().err


def one_error(code: int, err: str) -> str:
    """The single error line of a refused pre-flight."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("temper: config error: ")
    return lines[0]


def tiny_hf_folder(folder: Path, vocab_size: int = 768, **config_fields: Any) -> Path:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        **config_fields,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    shutil.copy(resources.files("temper.assets") / "tokenizer.json", folder / "tokenizer.json")
    return folder


def test_a_good_config_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    data.write_text(json.dumps({"messages": turns}) + "\n")
    lora = ["--lora.enable", "--lora.target_modules", "q_proj", "v_proj"]  # HF names work
    code, err = check(
        capsys, *SFT, *lora, "--data.path", str(data), "--job.dump_folder", str(tmp_path / "run")
    )
    assert code == 0, err


def test_missing_data_file_names_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.jsonl"
    line = one_error(*check(capsys, *SFT, "--data.path", str(missing)))
    assert f"data.path {missing}" in line and "no such file" in line


def test_missing_text_folder_names_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = one_error(*check(capsys, "--data.path", str(tmp_path / "corpus")))
    assert f"data.path {tmp_path / 'corpus'}" in line and "no such file or folder" in line


def test_bad_jsonl_line_names_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "chat.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    data.write_text(f"{good}\n{{not json\n")
    line = one_error(*check(capsys, *SFT, "--data.path", str(data)))
    assert f"data.path {data}: {data}:2: invalid JSON" in line


def test_bad_text_record_names_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "docs.jsonl"
    data.write_text('{"text": "a"}\n{"body": "b"}\n')
    line = one_error(*check(capsys, "--data.path", str(data)))
    assert f"{data}:2: record has no field 'text'" in line


def test_missing_chat_template(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(resources.files("temper.assets") / "tokenizer.json", folder / "tokenizer.json")
    line = one_error(*check(capsys, *SFT, "--data.tokenizer_path", str(folder)))
    assert "data.chat_template" in line and "no chat template" in line


def test_tokenizer_larger_than_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf = tiny_hf_folder(tmp_path / "hf", vocab_size=256)
    line = one_error(*check(capsys, "--model.hf_path", str(hf)))
    assert f"model.hf_path {hf}: the tokenizer has 688 tokens" in line
    assert "embeds only 256" in line


def test_model_folder_without_a_tokenizer_names_the_ways_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf = tiny_hf_folder(tmp_path / "hf")
    (hf / "tokenizer.json").unlink()
    line = one_error(*check(capsys, "--model.hf_path", str(hf)))
    assert f"model.hf_path {hf}: tokenizer file not found" in line
    assert "--data.tokenizer_path" in line
    builtin = line.rsplit(" ", 1)[1]  # the built-in tokenizer's file ends the line
    assert builtin == str(builtin_tokenizer_path())
    # Following the second way out passes the pre-flight.
    code, err = check(
        capsys,
        "--model.hf_path",
        str(hf),
        "--data.tokenizer_path",
        builtin,
        "--job.dump_folder",
        str(tmp_path / "run"),
    )
    assert code == 0, err


def test_lora_targets_that_match_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--lora.enable", "--lora.target_modules", "layers.*.nothing"]
    line = one_error(*check(capsys, *args, "--job.dump_folder", str(tmp_path)))
    assert "lora.target_modules 'layers.*.nothing' matches no linear layer" in line
    assert "Hugging Face names: down_proj, gate_proj" in line


def test_initial_load_of_another_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf_to_dcp(tiny_hf_folder(tmp_path / "hf"), tmp_path / "ckpt")
    args = ["--checkpoint.initial_load", str(tmp_path / "ckpt")]
    line = one_error(*check(capsys, *args, "--job.dump_folder", str(tmp_path / "run")))
    assert f"checkpoint.initial_load {tmp_path / 'ckpt'} holds another model" in line
    assert "model.args.dim: checkpoint 32" in line


def test_resume_step_that_does_not_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--checkpoint.enable", "--checkpoint.resume", "7"]
    line = one_error(*check(capsys, *args, "--job.dump_folder", str(tmp_path)))
    assert "checkpoint.resume 7: no complete checkpoint" in line


def test_unwritable_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    line = one_error(*check(capsys, "--job.dump_folder", str(blocker / "run")))
    assert f"job.dump_folder {blocker / 'run'}: not writable" in line


def test_the_cli_exits_2_with_one_line(tmp_path: Path) -> None:
    """The same check as run_train.sh runs it: a process, its exit code and stderr."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    missing = tmp_path / "nope.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "temper.train", "--check_only", *SFT, "--data.path", str(missing)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"temper: config error: data.path {missing}: {missing}: no such file or folder"
    ]


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--optimizer.lr", "nan"), ("--optimizer.eps", "inf"), ("--training.max_norm", "nan")],
)
def test_non_finite_numbers_exit_2_naming_the_field(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = one_error(*check(capsys, flag, value))
    assert line == f"temper: config error: {flag[2:]}: {value} is not a finite number"


def test_seq_len_above_the_flavors_positions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--training.seq_len", "100000", "--job.dump_folder", str(tmp_path)]
    line = one_error(*check(capsys, *args))
    assert line == (
        "temper: config error: training.seq_len (100000) is above the model's 2048 positions "
        "(max_seq_len of llama3/debug): lower --training.seq_len, or train a model with a RoPE "
        "scaling (rope_scaling, e.g. yarn, in an HF folder's config.json), which allows longer "
        "sequences"
    )


def test_seq_len_above_an_hf_folders_positions_unless_rope_is_scaled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf = tiny_hf_folder(tmp_path / "hf", max_position_embeddings=64)
    run = ["--model.hf_path", str(hf), "--job.dump_folder", str(tmp_path / "run")]
    assert check(capsys, *run, "--training.seq_len", "64") == (0, "")
    line = one_error(*check(capsys, *run, "--training.seq_len", "65"))
    assert "training.seq_len (65) is above the model's 64 positions " in line
    assert f"(max_position_embeddings of {hf}/config.json)" in line
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0}
    rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    scaled = tiny_hf_folder(tmp_path / "scaled", max_position_embeddings=64, rope_parameters=rope)
    run[1] = str(scaled)
    assert check(capsys, *run, "--training.seq_len", "256") == (0, "")
