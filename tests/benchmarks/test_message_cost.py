"""The message-cost benchmark runs both transports between two real processes and each delivers
the sent tensor (its costs are printed, not asserted: timed tests are noise on shared machines)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_message_cost_runs_both_transports(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "message_cost.py"), "--messages", "20", "--reps", "1",
                        "--work-ms", "0.2", "--kb", "8"], capture_output=True, text=True,
                       timeout=110, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert lines[0].startswith("20 messages of 8 KiB")
    assert [ln.split()[0] for ln in lines[1:3]] == ["gloo", "shared"]
