"""Discovery: `./run_train.sh --list` names every built-in recipe (with its docstring's first
sentence) and model family (with its flavors); `--help` starts with MODULE, CONFIG, NGPU."""

from __future__ import annotations

import importlib
import inspect
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
    for module in builtin_recipe_modules():
        assert f"  {module}" in lines
        mod = importlib.import_module(module)
        for name in recipe_names(mod):
            first = inspect.getdoc(getattr(mod, name)).split("\n")[0]
            assert any(line.split()[:1] == [name] and first in line for line in lines), name
    for spec in all_model_specs():
        assert f"  {spec.name:<12} {', '.join(spec.flavors)}" in lines


def test_help_starts_with_module_config_and_ngpu(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("usage: MODULE=<module> CONFIG=<function> NGPU=<n> ./run_train.sh")
    names = [line.split()[0] for line in lines[1:9] if line.startswith("  ") and line[2] != " "]
    assert names[:3] == ["MODULE", "CONFIG", "NGPU"]
    assert any("--training.steps" in line for line in lines)  # then the recipe's fields
