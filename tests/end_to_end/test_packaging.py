"""The wheel ships every package: pyproject.toml lists packages explicitly (conf/ is mapped in)."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[2]


def test_every_subpackage_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "launcher").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found | {"launcher.conf"} <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages"
    assert (ROOT / "conf" / "__init__.py").exists()


def test_scheduler_imports_without_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, launcher.schedule, launcher.plan, "
            "launcher.plan.from_config, launcher.plan.table; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
