"""The transformer benchmark against PyTorch's native schemes runs, and both sides compute the same
step on the built-in GPT and on Hugging Face's Llama.

Speed is not asserted (timed tests are noise on shared machines); the benchmark prints the ratios.
What must hold: every pair's first-step loss and stage-0 gradient norm agree with the native
implementation's to 1e-6 relative, and every pair has its ratios and a prediction."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quick_transformer_benchmark_agrees_with_native(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "vs_native_transformer.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vs_native_transformer.py"), "--quick", "--json",
                        str(out)], check=False, capture_output=True, text=True, timeout=230, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["model"] for r in rows} == {"GPT", "Llama"}
    assert {r["native"] for r in rows} == {"FSDP2", "InterleavedZeroBubble"}
    for r in rows:
        assert r["W"] == 4
        assert r["agree"] and r["loss_rel_diff"] <= 1e-6 and r["g0_rel_diff"] <= 1e-6, r
        assert r["loss"][0] > 0 and r["g0"][0] > 0
        for key in ("ratio", "cpu_ratio", "predicted_s", "predicted_over_measured", "ours_median_s", "native_median_s",
                    "ours_cpu_s", "native_cpu_s"):
            assert r[key] > 0, (key, r)
