"""The package's import graph: no cycle between temper's top-level packages, and
``temper.config`` a leaf. Every import statement counts, function-level and
``TYPE_CHECKING`` ones included, since each is a dependency a reader must follow."""

from __future__ import annotations

import ast
from pathlib import Path

import temper

ROOT = Path(temper.__file__).resolve().parent


def package_imports() -> dict[str, set[str]]:
    """Top-level package -> the other top-level packages its modules import."""
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        source = parts[0] if len(parts) > 1 else "<root>"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")
                if top[0] == "temper" and len(top) > 1 and top[1] != source:
                    edges.setdefault(source, set()).add(top[1])
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each cycle, found by a depth-first walk from every package."""
    found: list[list[str]] = []

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(edges.get(node, ())):
            if nxt == path[0]:
                cycle = sorted(path)
                if cycle not in found:
                    found.append(cycle)
            elif nxt not in path and nxt > path[0]:
                walk(nxt, [*path, nxt])

    for start in sorted(edges):
        walk(start, [start])
    return found


def test_no_cycles_between_top_level_packages() -> None:
    assert cycles(package_imports()) == []


def test_config_imports_nothing_else_from_temper() -> None:
    assert package_imports().get("config", set()) == set()


def test_the_cycle_finder_finds_cycles() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
