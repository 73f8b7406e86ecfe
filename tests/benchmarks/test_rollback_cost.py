"""The rollback benchmark runs on a small tensor set and prints each optimizer's three sides (its
times are printed, not asserted; it asserts one rollback per repetition itself)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_rollback_cost_runs_for_each_optimizer(tmp_path):
    script = ROOT / "benchmarks" / "rollback_cost.py"
    p = subprocess.run([sys.executable, str(script), "--params", "1000", "--reps", "2"], capture_output=True, text=True,
                       timeout=110, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines[1:]] == ["SGD(momentum=0.9)", "Adam", "AdamW(weight_decay=0.01)"]
    assert all("take+validate (rolled back)" in ln for ln in lines[1:])
