"""The suite as a newcomer meets it: unit tests run first, and the README's test commands
select tests (pytest exits 5 when a command selects none)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def collect(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:logging", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_unit_tests_are_collected_first() -> None:
    result = collect(
        "tests/integration/test_grpo_example.py",
        "tests/distributed/test_grad_norm.py",
        "tests/unit/test_cli.py",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    ids = [line for line in result.stdout.splitlines() if "::" in line]
    folders = [line.split("/")[1] for line in ids]
    assert folders == sorted(folders, key=["unit", "distributed", "integration"].index)
    assert set(folders) == {"unit", "distributed", "integration"}


@pytest.mark.slow  # a pytest process collecting test files (8 s here)
def test_readme_test_commands_select_tests() -> None:
    """Each ``./run_tests.sh`` example of the README names paths that exist, and one that
    filters (``-k``, ``-m``, a ``::`` node) selects at least one test. A bare path needs no
    collection to prove: the whole suite, run by CI, collects every file in it."""
    readme = (ROOT / "README.md").read_text()
    commands = [
        shlex.split(match, comments=True)
        for match in re.findall(r"^\./run_tests\.sh (.+)$", readme, flags=re.M)
    ]
    named = [args for args in commands if any(arg.startswith("tests/") for arg in args)]
    assert named  # the README shows how to run a few
    for args in named:
        paths = [arg.split("::")[0] for arg in args if arg.startswith("tests/")]
        assert all((ROOT / path).exists() for path in paths), args
        if paths == args:
            continue
        result = collect(*args)
        assert result.returncode == 0, f"{args}: {result.stdout[-2000:]}"
        assert re.search(r"^(\d+)(/\d+)? tests? collected", result.stdout, flags=re.M), args
