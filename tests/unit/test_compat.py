"""Private torch APIs are reached through temper.utils.compat only, and each still exists in
the torch this suite runs on."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import temper
from temper.utils import compat

ROOT = Path(temper.__file__).resolve().parent
PRIVATE_MODULE = re.compile(r"^torch(\.\w+)*\._")


def private_uses(source: str) -> list[str]:
    """``from torch.x._y import``, ``import torch._y`` and ``torch._name`` in ``source``."""
    uses = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and PRIVATE_MODULE.match(node.module):
            uses.append(node.module)
        elif isinstance(node, ast.Import):
            uses += [a.name for a in node.names if PRIVATE_MODULE.match(a.name)]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            uses.append(f"torch.{node.attr}")
    return uses


def test_only_compat_touches_private_torch_apis() -> None:
    found = {
        str(path.relative_to(ROOT)): uses
        for path in ROOT.rglob("*.py")
        if path.name != "compat.py" and (uses := private_uses(path.read_text()))
    }
    assert found == {}


def test_the_scan_sees_each_form() -> None:
    source = "import torch._dynamo\nfrom torch.distributed._x import y\nz = torch._foo(1)\n"
    assert private_uses(source) == ["torch._dynamo", "torch.distributed._x", "torch._foo"]


def test_every_compat_name_resolves() -> None:
    for name in compat.__all__:
        assert callable(getattr(compat, name)), name
