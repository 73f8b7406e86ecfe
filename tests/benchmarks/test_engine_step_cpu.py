"""The one-worker engine-cost benchmark runs, and both sides train the same step (its speed is
printed, not asserted: timed tests are noise on shared machines)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_engine_step_cpu_runs_and_agrees_with_plain_pytorch(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine_step_cpu.py"), "--reps", "1", "--steps", "1",
                        "--size", "32,2,16,2"], capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert [ln.split()[0] for ln in lines[1:4]] == ["ours", "plain", "ratio"]
    ours, plain = (float(ln.split()[1]) for ln in lines[1:3])
    assert ours > 0 and plain > 0
    assert lines[4].startswith("first-step loss: ours ")
