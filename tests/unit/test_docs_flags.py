"""Every ``--section.field`` flag that README.md and docs/*.md show exists in the config, so
the docs cannot name a flag the CLI would refuse."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from temper.config import Config, objective_config_names, objective_config_type

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FLAG = re.compile(r"--([a-z][a-z0-9_]*)\.([a-z][a-z0-9_]*)")
NOT_BUILT_IN = {
    "--training.eval_every": "recipes.md: the field a user's own Training subclass adds",
    "--training.stepz": "recipes.md: the misspelt flag whose error it shows",
    "--objective.margin": "post-training.md: the field of the user objective it registers",
}


def fields_of(section: str) -> set[str]:
    """A section's flag names; the objective's are those of every registered objective."""
    if section == "objective":
        types = [objective_config_type(name) for name in objective_config_names()]
    else:
        types = [type(getattr(Config(), section))]
    return {f.name for cls in types for f in dataclasses.fields(cls)}


def unknown_flags(text: str) -> list[str]:
    sections = {f.name for f in dataclasses.fields(Config)}
    unknown = []
    for section, name in FLAG.findall(text):
        known = section in sections and (
            name in fields_of(section) or name.removeprefix("no_") in fields_of(section)
        )
        flag = f"--{section}.{name}"
        if not known and flag not in NOT_BUILT_IN:
            unknown.append(flag)
    return unknown


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_documented_flag_exists(page: Path) -> None:
    assert unknown_flags(page.read_text()) == []


def test_the_check_sees_a_stale_flag() -> None:
    assert unknown_flags("--training.steps 3 --metrics.no_tensorboard --objective.beta 1") == []
    assert unknown_flags("--training.stepx 3 --nope.steps 1") == [
        "--training.stepx",
        "--nope.steps",
    ]


def test_the_engine_pages_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/engine.md's first example, executed as written (in a scratch folder)."""
    text = (REPO / "docs" / "engine.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    printed: list[tuple] = []
    exec(compile(code, "docs/engine.md", "exec"), {"print": lambda *a: printed.append(a)})
    assert [row[0] for row in printed] == list(range(10))
    assert printed[-1][1] < printed[0][1]  # the loss fell
