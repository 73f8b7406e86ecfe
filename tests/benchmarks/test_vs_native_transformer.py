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


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quick_zbv_pair_agrees_with_native(tmp_path):
    """``zbv-w2`` (strategy=vshape, order=zbv on S = 4 stages) against ``ScheduleZBVZeroBubble`` on
    the same V-placed GPT stages: the same first step (GPT alone, to stay a short smoke run)."""
    out = tmp_path / "vs_native_transformer.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vs_native_transformer.py"), "--quick", "--models",
                        "gpt", "--pairs", "zbv-w2", "--json", str(out)], check=False, capture_output=True, text=True,
                       timeout=110, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    [r] = json.loads(out.read_text())["rows"]
    assert (r["pair"], r["native"], r["W"], r["S"], r["B"]) == ("zbv-w2", "ZBVZeroBubble", 2, 4, 8)
    assert r["agree"] and r["loss_rel_diff"] <= 1e-6 and r["g0_rel_diff"] <= 1e-6, r
    assert r["loss"][0] > 0 and r["g0"][0] > 0 and r["predicted_s"] > 0


def _benchmark():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import vs_native_transformer

    return vs_native_transformer


@pytest.mark.parametrize("W", [2, 4])
def test_v_placement_is_torchs(W):
    """Our vshape worker of each stage is the rank torch's ``style="v"`` mapping gives it (the native
    side builds its two ``PipelineStage`` per rank from that mapping)."""
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    from launcher.schedule import make_schedule

    step = make_schedule("vshape", 2 * W, 8, order="zbv", split_backward=True)
    assert {s: step.placement(s, 0, "F")[1] for s in range(2 * W)} == generate_stage_to_rank_mapping(W, 2 * W, "v")


def test_pairs_our_registry_lacks_are_skipped():
    """A pair whose order our registry lacks is skipped with its reason, not run; every pair the
    benchmark lists runs."""
    import dataclasses

    bench = _benchmark()
    for p in bench.PAIRS:
        assert bench.runnable(p) is None, p.name
    missing = dataclasses.replace(bench.PAIRS[0], name="x", order="no_such_order")
    assert "no_such_order" in bench.runnable(missing)


def test_ratio_interval_holds_the_ratio_and_narrows_with_a_steady_gap():
    """The printed interval of ours/native: it holds the ratio of the medians; a side that is 10%
    faster on every paired step gives an interval near 0.9 that leaves out 1.0; two sides whose
    steps take turns being faster give one that holds 1.0; too few steps give none."""
    import math
    import random

    ratio_interval = _benchmark().ratio_interval
    rng = random.Random(0)
    native = [0.1 + 0.02 * rng.random() for _ in range(27)]
    lo, hi = ratio_interval([0.9 * t for t in native], native)
    assert 0.85 < lo <= 0.9 <= hi < 0.95
    ours = [t * (1.05 if i % 2 else 0.95) for i, t in enumerate(native)]
    lo, hi = ratio_interval(ours, native)
    assert lo < 1.0 < hi
    assert all(math.isnan(v) for v in ratio_interval([0.1, 0.2], [0.1, 0.2]))


def test_pool_pools_every_step_of_each_pair(tmp_path, capsys):
    """``--pool`` reads earlier runs' ``--json`` and prints each pair's ratio per run and over all
    their steps together, each run's steps over its own native median."""
    bench = _benchmark()
    paths = []
    for k, (ours, native) in enumerate((([1.0, 1.1, 1.2], [2.0, 2.1, 2.2]), ([3.0, 3.0, 3.0], [2.0, 2.0, 2.0]))):
        row = {"model": "GPT", "d": 128, "pair": "interleaved-1f1b-w2", "W": 2, "ours_s": ours, "native_s": native,
               "ratio": sorted(ours)[1] / sorted(native)[1], "ours_cpu_s": 1.0, "native_cpu_s": 2.0}
        paths.append(tmp_path / f"run{k}.json")
        paths[-1].write_text(json.dumps({"rows": [row]}))
    assert bench.main(["--pool", ",".join(map(str, paths))]) == 0
    out = capsys.readouterr().out
    # pooled: 1.0 1.1 1.2 over 2.1 and 3 3 3 over 2 (median 1.036), over 2.0 2.1 2.2 over 2.1 and
    # 2 2 2 over 2 (median 1)
    assert "0.52, 1.50" in out and "0.50, 0.50" in out and "1.036" in out
