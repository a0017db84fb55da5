"""scripts/generate.py end to end on a tiny HF folder and the checkpoint made from it: it prints
what the Python API generates for the same prompts and settings."""

from __future__ import annotations

import json
import runpy
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from temper.checkpoint.convert import hf_to_dcp
from temper.data.chat import BUILTIN_TEMPLATE, render_chat, stop_token_ids
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


def tiny_hf_folder(folder: Path) -> Path:
    """A random tiny Llama with the built-in tokenizer, saved as an HF folder."""
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
    return folder


@pytest.mark.slow  # two interpreter starts
def test_script_prints_the_api_generation(tmp_path: Path) -> None:
    folder = tiny_hf_folder(tmp_path / "hf")
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


def test_evaluate_script_scores_greedy_answers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Answers set to the model's own greedy completions for two of four prompts: the script
    reports exactly half, and prints those completions."""
    folder = tiny_hf_folder(tmp_path / "hf")
    tokenizer = load_tokenizer(str(folder))
    questions = ["sort: 3 1 2", "copy: a b", "sort: 9 8", "copy: z"]
    prompts = [
        tokenizer.encode(render_chat(BUILTIN_TEMPLATE, [{"role": "user", "content": q}], True))
        for q in questions
    ]
    out = generate(
        load_hf(folder), prompts, 6, stop_tokens=stop_token_ids(tokenizer, BUILTIN_TEMPLATE)
    )
    greedy = out.texts(tokenizer.decode, stop_token_ids(tokenizer, BUILTIN_TEMPLATE))
    answers = [greedy[0], "not it", greedy[2], "not it either"]
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": q, "answer": a}) + "\n"
            for q, a in zip(questions, answers, strict=True)
        )
    )
    evaluate = runpy.run_path(str(ROOT / "scripts" / "evaluate.py"))["main"]
    template = tmp_path / "template.jinja"
    template.write_text(BUILTIN_TEMPLATE)
    args = ["--hf", str(folder), "--data", str(data), "--chat-template", str(template)]
    args += ["--max-new-tokens", "6", "--show", "4"]
    assert evaluate(args) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == "exact match 0.5000 (2/4)"
    assert printed[0] == f"{questions[0]!r} -> {greedy[0]!r} (answer {greedy[0]!r})"
