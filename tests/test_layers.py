"""The packages of ``launcher/`` import downward only (docs/design.md, "Where the code lives"):
``schedule/`` nothing else of the launcher, ``torch_support/`` only ``schedule/``, and the models
and the cutter the torch helpers, never the engine (``runtime/``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "launcher"
#: each package and the launcher packages (or top-level modules) it may import
ALLOWED = {
    "schedule": set(),
    "torch_support": {"schedule"},
    "models": {"schedule", "torch_support"},
    "split": {"schedule", "torch_support"},
}


def imported(package: str) -> dict[str, str]:
    """Each launcher package (or top-level module) that ``package``'s modules import, with one file
    that does, function-level imports included."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        here = path.relative_to(ROOT).parts[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                if isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name.startswith("launcher."):
                            found.setdefault(a.name.split(".")[1], str(path))
                continue
            if node.level == 0:
                if not (node.module or "").startswith("launcher"):
                    continue
                parts = (node.module or "").split(".")[1:] or [a.name for a in node.names]
            else:
                parts = list(here[:len(here) - (node.level - 1)]) + [p for p in (node.module or "").split(".") if p]
                parts = parts or [a.name for a in node.names]
            found.setdefault(parts[0], str(path))
    found.pop(package, None)
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_the_layers_below_it(package):
    wrong = {k: v for k, v in imported(package).items() if k not in ALLOWED[package]}
    assert not wrong, f"{package}/ imports {sorted(wrong)} (e.g. {next(iter(wrong.values()))})"


def test_the_check_sees_an_upward_import():
    # the engine's package imports the torch helpers: the same reading finds it
    assert "torch_support" in imported("runtime") and "schedule" in imported("torch_support")
