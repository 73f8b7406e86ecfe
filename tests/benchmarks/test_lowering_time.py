"""The lowering benchmark runs the old lowering (from git history) beside today's on one step, and
both give the same messages (its times are printed, not asserted: timed tests are noise on shared
machines)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs the git history")
def test_lowering_time_runs_old_and_new_alike(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lowering_time.py"), "--repeats", "1",
                        "--size", "fslpp,4,8,2,2", "--cache", "job"], capture_output=True, text=True, timeout=110,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert lines[0].startswith("fslpp S=4 B=8 G=2 R=2: 64 jobs, weight_cache=job")
    assert [ln.split()[0] for ln in lines[1:4]] == ["old", "new", "ratio"]
