"""The overlap benchmark runs one case once under each rule and prints its ratios (its times are
printed, not asserted; it checks itself that each run followed its rule)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_step_overlap_benchmark_runs_both_rules(tmp_path):
    script = ROOT / "benchmarks" / "step_overlap.py"
    p = subprocess.run([sys.executable, str(script), "--cases", "1", "--reps", "1", "--steps", "3"],
                       capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = p.stdout.splitlines()[1:]
    assert [r.split()[4] for r in rows[:3]] == ["post_validation", "none", "ratio"]
    assert re.search(r"rollbacks \[0, \d+, \d+, \d+\]", rows[2]), rows[2]
    # the same model's ratio beside the measured one, the CPU ratio and the load it ran under
    assert re.search(r"agree within 10%: (yes|no); .*one profile's \d\.\d+; cpu \d\.\d+ against \d\.\d+; "
                     r"load \d+\.\d-\d+\.\d", rows[2]), rows[2]
    assert re.fullmatch(r"agree within 10%: [01] of 1 cases", rows[3]), rows[3]
