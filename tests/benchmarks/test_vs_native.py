"""The benchmark against PyTorch's native schemes runs, and both sides compute the same step.

Speed is not asserted here (timed tests are noise on shared machines); the benchmark prints the
ratios. What must hold: every pair's first-step loss and stage-0 gradient norm agree with the
native implementation's to 1e-6 relative, and every pair has a ratio and a prediction."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_quick_benchmark_agrees_with_native(tmp_path):
    out = tmp_path / "vs_native.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vs_torch_native.py"), "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    natives = {r["native"] for r in rows}
    assert natives == {"DDP", "FSDP2", "GPipe", "1F1B", "LoopedBFS", "Interleaved1F1B", "InterleavedZeroBubble",
                       "FSDP2 + LoopedBFS", "FSDP2 + Interleaved1F1B"}  # the last: fslpp at its default order
    for r in rows:
        assert r["agree"] and r["loss_rel_diff"] <= 1e-6 and r["g0_rel_diff"] <= 1e-6, r
        assert r["loss"][0] > 0 and r["g0"][0] > 0
        assert r["ratio"] > 0 and r["predicted_s"] > 0 and r["ours_median_s"] > 0 and r["native_median_s"] > 0
