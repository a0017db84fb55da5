"""The console of a run: the model it built, Ctrl-C at a step boundary naming the latest
checkpoint, a rerun that says where it resumed, a finished run that says so."""

from __future__ import annotations

import json
import os
import shutil
import signal
from importlib import resources
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from temper.train import main
from temper.trainer.trainer import Trainer

TINY = [
    "--training.steps", "8",
    "--training.seq_len", "16",
    "--training.local_batch_size", "2",
    "--checkpoint.enable",
    "--checkpoint.interval", "3",
    "--metrics.no-tensorboard",
]  # fmt: skip


def stdout_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("temper:")]


def test_ctrl_c_stops_at_a_step_boundary_and_the_rerun_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    args = [*TINY, "--job.dump_folder", str(tmp_path)]
    ckpt = tmp_path / "checkpoints"
    step = Trainer.train_step

    def interrupted_at_5(self: Trainer, micro_batches):  # noqa: ANN001, ANN202
        metrics = step(self, micro_batches)
        if self.state.step == 5:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of the run
        return metrics

    monkeypatch.setattr(Trainer, "train_step", interrupted_at_5)
    assert main([*args, "--checkpoint.no_save_on_stop"]) == 130
    lines = stdout_lines(capsys)
    assert lines[-1] == (
        f"temper: stopped at step 5 on Ctrl-C; latest checkpoint {ckpt / 'step-3'}; "
        "rerun the same command to resume"
    )
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]  # step 5 finished, no step 6

    # By default the stop saves the step reached (here step 5 again, after the resume at 3).
    assert main(args) == 130
    lines = stdout_lines(capsys)
    assert lines[1] == f"temper: resumed from step 3/8 ({ckpt / 'step-3'})"
    assert lines[-2] == "temper: saving step 5 before stopping (Ctrl-C again: exit now)"
    assert lines[-1] == (
        f"temper: stopped at step 5 on Ctrl-C; latest checkpoint {ckpt / 'step-5'}; "
        "rerun the same command to resume"
    )

    monkeypatch.setattr(Trainer, "train_step", step)
    assert main(args) == 0
    lines = stdout_lines(capsys)
    assert lines[1] == f"temper: resumed from step 5/8 ({ckpt / 'step-5'})"
    assert lines[-1].startswith("temper: done: 3 steps in ")
    assert lines[-1].endswith(f"; checkpoint {ckpt / 'step-8'}")

    assert main(args) == 0
    assert stdout_lines(capsys) == [
        f"temper: the run is already complete at step 8 ({ckpt / 'step-8'}); nothing to do "
        "(a new job.dump_folder or more training.steps trains again)"
    ]


def test_the_startup_line_names_the_hf_model_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf = tmp_path / "Qwen3-tiny"
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=768,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    reference = Qwen3ForCausalLM(config)
    reference.save_pretrained(hf)
    shutil.copy(resources.files("temper.assets") / "tokenizer.json", hf / "tokenizer.json")
    lora = ["--lora.enable", "--lora.rank", "2", "--lora.target_modules", "layers.*.attention.wq"]
    run = tmp_path / "run"
    args = ["--model.hf_path", str(hf), *lora, "--job.dump_folder", str(run)]
    assert main([*TINY, "--training.steps", "1", *args]) == 0
    total = sum(p.numel() for p in reference.parameters())  # tied: the table counts once
    adapters = 2 * (2 * 32 + 32 * 2)  # two layers of A [2, 32], B [32, 2]
    building, first = stdout_lines(capsys)[:2]
    assert building == f"temper: building the model, weights from {hf}"
    expected = f"temper: qwen3/Qwen3-tiny from {hf}, {(total + adapters) / 1e3:.1f}K params "
    assert first.startswith(expected + f"({adapters} trainable) on cpu (float32)")
    saved = json.loads((run / "config.json").read_text())["model"]
    assert (saved["name"], saved["flavor"]) == ("qwen3", "Qwen3-tiny")


def test_stop_names_what_asked_for_it(tmp_path) -> None:
    """SIGTERM (a scheduler, ``timeout``) stops like Ctrl-C, and the line says which."""
    from temper.trainer.console import StopRequest, stopped_line

    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
    assert stop.cause == "SIGTERM"
    line = stopped_line(7, tmp_path, checkpointing=False, cause=stop.cause)
    expected = "no checkpoint saved (--checkpoint.enable saves them)"
    assert line == f"temper: stopped at step 7 on SIGTERM; {expected}"
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
    assert stop.cause == "Ctrl-C"


def test_sigterm_exits_143_and_ctrl_c_130(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exit code follows the signal, as a shell reports a process that it ended."""
    step = Trainer.train_step
    for sig, code, cause in ((signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "Ctrl-C")):

        def stopped_at_2(self: Trainer, micro_batches, sig=sig):  # noqa: ANN001, ANN202
            metrics = step(self, micro_batches)
            if self.state.step == 2:
                os.kill(os.getpid(), sig)
            return metrics

        monkeypatch.setattr(Trainer, "train_step", stopped_at_2)
        args = [*TINY[:6], "--metrics.no-tensorboard", "--job.dump_folder", str(tmp_path / cause)]
        assert main(args) == code
        assert stdout_lines(capsys)[-1] == (
            f"temper: stopped at step 2 on {cause}; no checkpoint saved (--checkpoint.enable "
            "saves them)"
        )


def test_a_rank_stopped_by_another_takes_its_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM reached another rank only: this one stops too, naming it, and exits 143."""
    import temper.trainer.console as console

    monkeypatch.setattr(console, "all_reduce_sum", lambda votes: votes + torch.tensor([0, 1]))
    with console.StopRequest() as stop:
        assert stop.agreed(torch.device("cpu"))
    assert (stop.cause, stop.exit_code) == ("SIGTERM", 143)
    monkeypatch.setattr(console, "all_reduce_sum", lambda votes: votes)
    with stop:
        assert not stop.agreed(torch.device("cpu"))


def test_run_counts_name_their_units() -> None:
    """Trained tokens are the labelled positions, positions every one the model ran, pairs a
    DPO batch's rows; a row without a label is counted (hand-built batches)."""
    from temper.trainer.console import RunCounts, summary_line

    counts = RunCounts()
    labels = torch.tensor([[-100, 5, 6, -100], [-100, -100, -100, -100]])
    counts.add({"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": labels})
    assert counts.local == {"trained_tokens": 2, "positions": 8, "pairs": 0, "empty_label_rows": 1}
    pair = {
        "chosen_input_ids": torch.zeros(3, 5, dtype=torch.long),
        "chosen_labels": torch.full((3, 5), 7),
        "rejected_input_ids": torch.zeros(3, 5, dtype=torch.long),
        "rejected_labels": torch.full((3, 5), -100).index_fill(1, torch.tensor([4]), 1),
    }
    counts.add(pair)
    assert counts.local == {
        "trained_tokens": 2 + 15 + 3,
        "positions": 8 + 30,
        "pairs": 3,
        "empty_label_rows": 1,
    }
    line = summary_line(2, 61.0, counts.local, 0.5, Path("/nowhere"), checkpointing=False)
    assert line == (
        "temper: done: 2 steps in 00:01:01, 20 tokens trained, 38 positions computed, 3 pairs, "
        "last loss 0.5000"
    )


def test_truncation_is_said_once_when_it_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "--module", "temper.recipes.posttrain",
        "--config", "sft_debug",
        "--training.steps", "3",
        "--training.seq_len", "16",
        "--metrics.no-tensorboard",
        "--job.dump_folder", str(tmp_path),
    ]  # fmt: skip
    assert main(args) == 0
    lines = stdout_lines(capsys)
    notices = [line for line in lines if "samples cut to" in line]
    assert len(notices) == 1, lines
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first = next(row for row in rows if row["data_truncated"])
    assert notices[0] == (
        f"temper: step {first['step']}: {int(first['data_truncated']):,} samples cut to "
        "training.seq_len + 1 (17 tokens) (data.max_length_policy truncate; data_truncated)"
    )
    last = rows[-1]
    assert lines[-1].startswith("temper: done: 3 steps in ")
    assert (
        f"{int(last['data_trained_tokens']):,} tokens trained, "
        f"{int(last['data_positions']):,} positions computed, last loss" in lines[-1]
    )
    assert int(last["data_positions"]) == 3 * 8 * 16  # steps x rows x seq_len


SECOND_CTRL_C = """
import os, signal, sys, torch
from temper.trainer.console import StopRequest
with StopRequest():
    print("blocked", flush=True)
    torch.futures.Future().wait()  # a C++ wait that never returns and runs no Python handler
print("returned", flush=True)
"""


def test_a_second_ctrl_c_exits_during_a_long_operation(tmp_path: Path) -> None:
    """Two Ctrl-C's while the main thread is inside one C++ call (where Python runs no
    handler): the process exits 130 without the call returning."""
    import subprocess
    import sys
    import time

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    run = subprocess.Popen(
        [sys.executable, "-c", SECOND_CTRL_C],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert run.stdout is not None and run.stdout.readline() == "blocked\n"
    run.send_signal(signal.SIGINT)
    run.send_signal(signal.SIGINT)  # at once: one press (torchrun's agent forwards a copy)
    time.sleep(1.5)  # a second press comes later than console.SAME_PRESS_S
    run.send_signal(signal.SIGINT)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 130, err
    assert err.strip() == "temper: interrupted"
    assert "returned" not in out


def test_a_resumed_run_logs_the_counts_of_the_uninterrupted_one(tmp_path: Path) -> None:
    """The run's counts are checkpointed: step 2 after a resume at step 1 logs the totals the
    run without a stop logs at step 2 (before, they restarted from zero)."""

    def run(folder: Path, steps: int) -> dict:
        args = [*TINY, "--training.steps", str(steps)]
        assert main([*args, "--checkpoint.interval", "1", "--job.dump_folder", str(folder)]) == 0
        return json.loads((folder / "metrics.jsonl").read_text().splitlines()[-1])

    whole = run(tmp_path / "whole", 2)
    run(tmp_path / "resumed", 1)
    resumed = run(tmp_path / "resumed", 2)
    counts = {k: v for k, v in whole.items() if k.startswith("data_")}
    assert resumed["step"] == whole["step"] == 2 and counts["data_positions"] > 0
    assert {k: resumed[k] for k in counts} == counts
