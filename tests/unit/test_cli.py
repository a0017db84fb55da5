"""Discovery: `./run_train.sh --list` names every built-in recipe (with its docstring's first
sentence) and model family (with its flavors); `--help` starts with MODULE, CONFIG, NGPU."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from temper.config.loading import builtin_recipe_modules, recipe_names
from temper.models.registry import all_model_specs
from temper.train import main

ROOT = Path(__file__).resolve().parents[2]


def test_list_names_every_recipe_and_family() -> None:
    env = {**os.environ, "TEMPER_PYTHON": sys.executable}
    result = subprocess.run(
        [str(ROOT / "run_train.sh"), "--list"], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    text = " ".join(result.stdout.split())
    listed = [line.strip() for line in lines if line.startswith("    ") and line[4] != " "]
    defined = []
    for module in builtin_recipe_modules():
        assert f"  {module}" in lines
        mod = importlib.import_module(module)
        for name in recipe_names(mod):
            recipe = getattr(mod, name)
            if recipe.__module__ != module:
                continue  # re-exported (posttrain's sft_debug in precision): listed where defined
            defined.append(name)
            first = " ".join(inspect.getdoc(recipe).split("\n")[0].split())
            assert f"{name} {first}" in text, name
    assert listed == defined  # each recipe once, in module order
    assert len(set(listed)) == len(listed)
    assert max(len(line) for line in lines) <= 88
    for spec in all_model_specs():
        assert f"  {spec.name:<12} {', '.join(spec.flavors)}" in lines


def test_help_starts_with_module_config_and_ngpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("usage: MODULE=<module> CONFIG=<function> NGPU=<n> ./run_train.sh")
    names = [line.split()[0] for line in lines[1:9] if line.startswith("  ") and line[2] != " "]
    assert names[:3] == ["MODULE", "CONFIG", "NGPU"]
    # The short form: every section named, the common flags with the recipe's values, wrapped.
    assert "  --training.steps 60" in lines  # llama3_debug's value
    assert "  --optimizer.lr 0.002" in lines
    assert not any("--profiling.trace_steps" in line for line in lines)
    text = " ".join(" ".join(lines).split())
    assert "job, model, training, optimizer, lr_scheduler, data" in text
    assert max(len(line) for line in lines) <= 92
    assert len(lines) < 80


def test_help_all_lists_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help_all"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: MODULE=<module>")
    for flag in ("--training.steps", "--profiling.trace_steps", "--checkpoint.keep_latest_k"):
        assert flag in out


def test_a_finished_run_is_answered_before_anything_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rerun of a complete run says so from the run folder alone: the one-process launch
    (--preflight) exits 0 and --check_only (before torchrun) exits 3, neither building the
    model nor reading the data nor importing the Engine; run_train.sh with NGPU=2 then
    launches nothing and exits 0."""
    import temper.trainer as trainer_module
    import temper.trainer.preflight as preflight_module

    run = ["--training.steps", "1", "--training.seq_len", "16", "--metrics.no-tensorboard"]
    run += ["--checkpoint.enable", "--job.dump_folder", str(tmp_path / "run")]
    assert main(["--preflight", *run]) == 0
    capsys.readouterr()

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a finished run built or read something")

    monkeypatch.setattr(trainer_module, "Trainer", refuse)
    monkeypatch.setattr(preflight_module, "preflight", refuse)
    step = tmp_path / "run" / "checkpoints" / "step-1"
    complete = f"temper: the run is already complete at step 1 ({step}); nothing to do"
    assert main(["--preflight", *run]) == 0
    assert capsys.readouterr().err.startswith(complete)
    assert main(["--check_only", *run]) == 3
    assert capsys.readouterr().err.startswith(complete)
    probe = PROBE.replace('"temper.trainer")', '"temper.trainer.trainer")')
    assert run_probe(probe, [["--check_only", *run]]) == [(3, [])]  # no Engine

    env = {**os.environ, "TEMPER_PYTHON": sys.executable, "NGPU": "2"}
    result = subprocess.run(
        [str(ROOT / "run_train.sh"), *run], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[-1].startswith(complete)
    assert "step " not in result.stdout  # no rank started


def test_help_all_wraps_each_field_help_as_one_paragraph(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every option's help is filled greedily: a line ends early only when the next word
    does not fit (tyro kept the breaks of indented docstring lines and wrapped each alone,
    leaving lines such as '(name and')."""
    with pytest.raises(SystemExit):
        main(["--help_all"])
    blocks: list[list[str]] = [[]]
    for line in capsys.readouterr().out.splitlines():
        text = line.strip("│").rstrip()  # boxes on a terminal, plain when captured
        if text.startswith(" " * 6) and text.strip():
            blocks[-1].append(text.strip())
        elif blocks[-1]:
            blocks.append([])
    width = max(len(text) for block in blocks for text in block)
    assert len(blocks) > 100
    for block in blocks:
        for line, after in zip(block, block[1:], strict=False):
            assert len(line) + 1 + len(after.split()[0]) > width, block


CASES = [
    (["--help"], 0),
    (["--help_all"], 0),
    (["--list"], 0),
    (["--training.stepz", "3"], 2),  # a flag tyro refuses
    (["--training.steps", "-1"], 2),  # a section's rule
    (["--parallelism.sp", "3"], 2),  # a registered component's rule
]

PROBE = """
import json, sys
from temper.train import main
heavy = ("torch._dynamo", "triton", "transformers", "temper.engine", "temper.trainer")
for argv in json.loads(sys.argv[1]):
    try:
        code = main(argv)
    except SystemExit as stop:  # tyro exits itself on --help_all and a flag it refuses
        code = stop.code
    print("probe:", json.dumps([code, [name for name in heavy if name in sys.modules]]))
"""


def run_probe(probe: str, argvs: list[list[str]]) -> list[tuple[int, list[str]]]:
    """Each command line's exit code and the heavy modules imported once it is answered, the
    command lines one after another in one fresh process (imports only accumulate, so one
    that imported a module shows it)."""
    result = subprocess.run(
        [sys.executable, "-c", probe, json.dumps(argvs)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    answers = [line for line in result.stdout.splitlines() if line.startswith("probe: ")]
    assert len(answers) == len(argvs), result.stdout[-2000:] + result.stderr[-2000:]
    return [tuple(json.loads(line.removeprefix("probe: "))) for line in answers]


@pytest.fixture(scope="module")
def probed() -> list[tuple[int, list[str]]]:
    """The cases in one process instead of six (about 20 s less)."""
    return run_probe(PROBE, [argv for argv, _ in CASES])


@pytest.mark.parametrize("case", range(len(CASES)), ids=[" ".join(a) for a, _ in CASES])
def test_help_list_and_config_errors_import_neither_the_engine_nor_dynamo(
    case: int, probed: list[tuple[int, list[str]]]
) -> None:
    """These answer from the config, its registered rules and the catalogs alone, so they
    import neither the Engine and trainer nor what takes the most of a full import (dynamo
    and triton, about a second here; transformers is never imported by temper.train)."""
    answered, imported = probed[case]
    assert answered == CASES[case][1], CASES[case][0]
    assert imported == []
