"""The fetched-copy benchmark runs, and a stage gives the same output on its own parameters, through
functional_call and through call_with (its speed is printed, not asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_fetched_call_runs_and_the_three_sides_agree(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fetched_call.py"), "--n", "2", "--d", "32"],
                       capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stdout.splitlines()
    sides = ["own parameters", "functional_call", "call_with"] * 2
    assert [side in ln for side, ln in zip(sides, lines[1:7])] == [True] * 6, lines
    assert lines[-1] == "outputs equal: yes"
