"""scripts/generate.py end to end on a tiny HF folder and the checkpoint made from it: it prints
what the Python API generates for the same prompts and settings."""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from temper.checkpoint.convert import hf_to_dcp
from temper.data.tokenizer import load_tokenizer
from temper.generation import generate
from temper.models import load_hf

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Once upon a time", "The cat sat on"]


def run_script(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def expected_output(folder: Path, new: int, temperature: float, **sampling: object) -> str:
    """The API's continuations, each up to EOS (left out), one per line as the script prints."""
    tokenizer = load_tokenizer(str(folder))
    out = generate(
        load_hf(folder),
        [tokenizer.encode(p) for p in PROMPTS],
        new,
        temperature,
        stop_tokens={tokenizer.eos_id},
        **sampling,
    )
    lines = []
    for row, length in zip(out.tokens.tolist(), out.lengths.tolist(), strict=True):
        ids = row[:length]
        lines.append(tokenizer.decode(ids[:-1] if ids[-1] == tokenizer.eos_id else ids) + "\n")
    return "".join(lines)


@pytest.mark.slow  # two interpreter starts
def test_script_prints_the_api_generation(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    builtin = load_tokenizer(None)
    config = LlamaConfig(
        vocab_size=builtin.vocab_size,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    shutil.copy(resources.files("temper.assets") / "tokenizer.json", folder / "tokenizer.json")
    prompts = [arg for p in PROMPTS for arg in ("--prompt", p)]

    greedy = run_script("--hf", str(folder), *prompts, "--max-new-tokens", "12")
    assert greedy == expected_output(folder, 12, 0.0)

    hf_to_dcp(folder, tmp_path / "step-0")
    sampled = run_script(
        "--checkpoint",
        str(tmp_path / "step-0"),
        *prompts,
        "--max-new-tokens",
        "12",
        "--temperature",
        "0.8",
        "--top-k",
        "50",
        "--seed",
        "3",
    )
    gen = torch.Generator().manual_seed(3)
    assert sampled == expected_output(folder, 12, 0.8, top_k=50, generator=gen)
