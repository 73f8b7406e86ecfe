"""The GPU check's dry run (``benchmarks/gpu_check.py --dry-run``): every part on CPU, gloo, tiny
sizes, so that a GPU run meets only CUDA's unknowns. Every scheme's oracle must pass in float32 and
bf16-mixed; the other parts must pass and report what the table shows. Also: the point-to-point
staging through host memory that gloo needs for GPU tensors, run here on CPU tensors."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from launcher.runtime import launch
from launcher.runtime.comm import host_staged, staged_irecv, staged_isend

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))

import gpu_check  # noqa: E402 - the benchmark's folder, put on the path above


@pytest.fixture(scope="module")
def dry(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, str]:
    out = tmp_path_factory.mktemp("gpu_check")
    p = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)], capture_output=True, text=True,
                       timeout=1100, cwd=out)
    assert (out / "gpu_check.json").exists(), p.stdout[-3000:] + p.stderr[-3000:]
    return p, json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.txt").read_text()


@pytest.mark.timeout(1200)
def test_dry_run_passes_every_part(dry):
    p, res, _ = dry
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert res["dry_run"] and res["card"]["backend"] == "gloo"
    assert res["summary"] == {"nccl": "passed", "oracle": "passed", "overhead": "passed", "native": "passed"}, \
        {k: v.get("reason") for k, v in res["parts"].items()}


@pytest.mark.timeout(1200)
def test_every_scheme_and_precision_matches_one_device(dry):
    cases = dry[1]["parts"]["oracle"]["cases"]
    want = {(s.name, p) for s in gpu_check.SCHEMES for p in gpu_check.PRECISIONS}
    assert {(c["scheme"], c["precision"]) for c in cases} == want
    for c in cases:
        assert c["status"] == "passed" and c["owned"] == list(range(gpu_check.S)), c
        if c["precision"] == "32-true":
            assert c["grad_rel"] < gpu_check.FP32_TOL and c["param_rel"] < gpu_check.FP32_TOL, c
        else:  # bf16 moves the single-device result (gap > 0); the engine stays within a few gaps of it
            assert 0 < c["bf16_gap"] < 0.5 and c["update_rel"] < gpu_check.BF16_FACTOR * c["bf16_gap"], c


@pytest.mark.timeout(1200)
def test_overhead_and_prediction_are_reported(dry):
    _, res, table = dry
    o = res["parts"]["overhead"]
    assert o["ours"]["step_s"] > 0 and o["plain"]["step_s"] > 0 and o["ratio"] > 0
    assert o["ours"]["predicted_step_s"] > 0 and o["ours"]["predicted_memory_bytes"] > 0
    assert all(t > 0 for side in o["ours"]["forward_s"].values() for t in side)
    assert o["mfu"] == {"ours": None, "plain": None}  # no peak rate for a CPU
    assert res["parts"]["nccl"]["collectives_ok"] and res["parts"]["native"]["ratio"] > 0
    for words in ("ddp 32-true W=4", "zb_h1 bf16-mixed W=4", "recompute-full 32-true W=4", "MFU ours / plain",
                  "step ms predicted / measured", "peak memory GB predicted / measured", "forward ms per stage",
                  "ddp-w1 gloo"):
        assert words in table, words


def test_a_part_that_does_not_fit_is_skipped(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--budget", "1"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(res["summary"].values()) == {"skipped"}
    assert "does not fit" in res["parts"]["oracle"]["reason"]


def _staged_exchange() -> list[float]:
    """Rank 1 sends through a host copy; rank 0's tensor gets the data only when it waits."""
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    if dist.get_rank() == 1:
        staged_isend(x * 7, 0, tag=5).wait()
        dist.barrier()
        return []
    buf = torch.zeros(2, 3)
    work = staged_irecv(buf, 1, tag=5)
    dist.barrier()  # the data has reached the host buffer by now
    before = buf.sum().item()
    work.wait()
    return [before, float((buf - x * 7).abs().max()), float(host_staged(buf))]


@pytest.mark.timeout(60)
def test_point_to_point_through_host_memory():
    before, err, staged = launch(_staged_exchange, 2, backend="gloo", timeout=20, deadline=50)[0]
    assert before == 0.0 and err == 0.0  # written into the tensor at the wait, exactly
    assert staged == 0.0  # a CPU tensor on gloo goes directly


def test_a_hung_part_fails_and_stops_the_check(tmp_path):
    """A part that hangs past its own bounds (its workers' supervisor stuck too) must not hold the
    machine: 30 s (here 1 s) past its budget it fails, the JSON and the log say so, every process
    the check started is killed, and the check exits with status 1."""
    code = f"""
import pathlib, subprocess, sys, time
sys.path.insert(0, {str(SCRIPT.parent)!r})
import gpu_check
gpu_check.HARD_GRACE = 1.0
run = gpu_check.Run(100.0, True, pathlib.Path({str(tmp_path)!r}))
def hang(budget):
    child = subprocess.Popen(["sleep", "300"])
    pathlib.Path({str(tmp_path / "child")!r}).write_text(str(child.pid))
    time.sleep(300)
run.part("nccl", 1.0, hang)
print("not reached")
"""
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "not reached" not in p.stdout, p.stdout + p.stderr
    assert time.perf_counter() - t < 60
    part = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]["nccl"]
    assert part["status"] == "failed" and "a hang" in part["reason"], part
    assert "nccl: FAILED" in (tmp_path / "gpu_check.log").read_text()
    assert "hang" in (tmp_path / "gpu_check.txt").read_text()
    stat = Path(f"/proc/{(tmp_path / 'child').read_text()}/stat")
    deadline = time.time() + 10
    while stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z" and time.time() < deadline:
        time.sleep(0.1)
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", "the part's child still runs"
