"""The GPU check (``scripts/gpu_check.sh``, ``benchmarks/gpu_check.py``) run here as a dry run: every
part on CPU over gloo at tiny sizes, so that a GPU run meets only CUDA's unknowns.

The parts that carry the most risk on the lent machine, ``env`` and ``flagship``, run in a bare
virtual environment built like that machine's image: torch, Lightning and the other packages of
the image that the launcher and the check import, no Hydra, OmegaConf or W&B; Hydra and OmegaConf
come from the wheels ``scripts/gpu_wheels.sh`` downloads (from PyPI), installed with ``--no-index``
as the GPU run installs them. The venv and the wheels are cached under the temporary folder, keyed by
what they hold. Also here: the parts ``overhead`` and ``benchmark`` in this environment, a part that
does not fit, a hung part, and the point-to-point staging through host memory that gloo needs for
GPU tensors, run on CPU tensors."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from launcher.runtime import launch
from launcher.runtime.comm import host_irecv, host_isend, host_staged

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
CHECK = ROOT / "scripts" / "gpu_check.sh"
WHEELS = ROOT / "scripts" / "gpu_wheels.sh"
sys.path.insert(0, str(SCRIPT.parent))

import gpu_check  # noqa: E402 - the benchmark's folder, put on the path above

#: the lent machine's image, as far as `python -m launcher` and the check import it (torch as the README pins
#: it; setuptools as the image has it)
BARE = ["torch==2.13.0", "lightning==2.6.6", "numpy", "matplotlib", "rich", "jinja2", "pyyaml", "typing-extensions",
        "scipy", "setuptools"]


def _cached(name: str, key: str, build) -> Path:
    """``build(path)`` once per ``key`` under the temporary folder (built aside, then renamed; a lock
    keeps two test runs from building it at once)."""
    base = Path(tempfile.gettempdir()) / f"launcher-{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    with open(f"{base}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not base.exists():
            tmp = Path(f"{base}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            build(tmp)
            tmp.rename(base)
    return base


def _bare_venv() -> Path:
    def build(path: Path) -> None:
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)
        subprocess.run([str(path / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile", *BARE], check=True,
                       timeout=600, capture_output=True)
    return _cached("bare-venv", f"{sys.version} {BARE}", build)


def _wheels() -> Path:
    def build(path: Path) -> None:
        subprocess.run(["bash", str(WHEELS), str(path)], check=True, timeout=300, capture_output=True)
    return _cached("gpu-wheels", WHEELS.read_text(), build)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dry_run_of_env_and_flagship_in_a_bare_venv(tmp_path):
    """``scripts/gpu_check.sh --dry-run --parts env,flagship`` where Hydra, OmegaConf and W&B are not
    installed: the wheels and this checkout go into a site folder, and ``python -m launcher`` runs
    every scheme at W=1 beside strategy=single in float32 and bf16-mixed (and the engine at W=4),
    each part writing its own JSON."""
    t = time.perf_counter()
    venv, wheels = _bare_venv(), _wheels()
    prepared = time.perf_counter() - t
    assert sum(f.stat().st_size for f in wheels.glob("*.whl")) < 1_000_000  # small: no W&B
    py = venv / "bin" / "python"
    assert subprocess.run([str(py), "-c", "import hydra"], capture_output=True).returncode != 0  # bare indeed
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}:{env['PATH']}", GPU_WHEELS=str(wheels),
               GPU_SITE=str(tmp_path / "site"), OUT=str(tmp_path / "out"))
    t = time.perf_counter()
    p = subprocess.run(["bash", str(CHECK), "--dry-run", "--parts", "env,flagship"], env=env, capture_output=True,
                       text=True, timeout=800)
    took = time.perf_counter() - t
    out = tmp_path / "out"
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    print(f"bare venv and wheels ready in {prepared:.0f} s; dry run {took:.0f} s")
    env_part, flagship = (json.loads((out / f"{n}.json").read_text()) for n in ("env", "flagship"))
    assert env_part["status"] == flagship["status"] == "passed" and env_part["dry_run"]
    site = str(tmp_path / "site")
    imports = env_part["imports"]
    assert imports["hydra"]["from"] == imports["omegaconf"]["from"] == imports["launcher"]["from"] == site
    assert imports["torch"]["from"].startswith(str(venv)) and not imports["wandb"]["ok"]
    assert env_part["collectives_ok"] and env_part["help"]["returncode"] == 0
    assert "hydra_core" in env_part["installed"] and "this checkout" in env_part["installed"]
    # every scheme in both precisions, beside strategy=single, with its prediction
    rows = {(r["scheme"], r["precision"]): r for r in flagship["oracle"]}
    assert set(rows) == {(s, p) for s in ("ddp", "fsdp", "lpp", "fslpp", "gpipe") for p in gpu_check.PRECISIONS}
    for r in rows.values():
        assert r["result"] == "passed" and r["status"] == "ok", r
        assert r["latency_s"]["predicted"] > 0 and r["peak_memory_bytes"]["measured"][0] > 0
    assert all(s["returncode"] == 0 for s in flagship["sweeps"].values())
    assert [c["status"] for c in flagship["engine_w4"]["cases"]] == ["passed"] * len(gpu_check.ENGINE_CASES)
    table = (out / "gpu_check.txt").read_text()
    assert "python -m launcher lpp (1f1b) bf16-mixed W=1 vs strategy=single" in table
    # the default logger needs W&B, which is not there: one sentence, exit 2, before anything runs
    q = subprocess.run([str(py), "-m", "launcher", "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'w'}"],
                       env={**env, "PYTHONPATH": site}, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert q.returncode == 2, q.stderr[-2000:]
    assert "logger=wandb is invalid here: the wandb package is not installed" in q.stderr
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dry_run_of_overhead_and_benchmark(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--parts", "overhead,benchmark", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=500, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    o = json.loads((tmp_path / "overhead.json").read_text())
    assert o["status"] == "passed" and o["part"] == "overhead"
    assert o["ours"]["step_s"] > 0 and o["plain"]["step_s"] > 0 and o["ratio"] > 0
    assert o["ours"]["predicted_step_s"] > 0 and o["ours"]["predicted_memory_bytes"] > 0
    assert all(t > 0 for side in o["ours"]["forward_s"].values() for t in side)
    assert o["mfu"] == {"ours": None, "plain": None}  # no peak rate for a CPU
    b = json.loads((tmp_path / "benchmark.json").read_text())
    assert b["status"] == "passed" and b["ratio"] > 0
    table = (tmp_path / "gpu_check.txt").read_text()
    for words in ("MFU ours / plain", "step ms predicted / measured", "peak memory GB predicted / measured",
                  "forward ms per stage", "ddp-w1 gloo"):
        assert words in table, words


def test_a_part_that_does_not_fit_is_skipped_and_says_so_in_its_file(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--budget", "1"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    for part in gpu_check.PARTS:
        res = json.loads((tmp_path / f"{part}.json").read_text())
        assert res["status"] == "skipped" and "does not fit" in res["reason"], res
    q = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--parts", "env,nccl"], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert q.returncode == 2 and "--parts=env,nccl is invalid" in q.stderr, q.stderr


def _staged_exchange() -> list[float]:
    """Rank 1 sends through a host copy; rank 0's tensor gets the data only when it waits."""
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    if dist.get_rank() == 1:
        host_isend(x * 7, 0, tag=5).wait()
        dist.barrier()
        return []
    buf = torch.zeros(2, 3)
    work = host_irecv(buf, 1, tag=5)
    dist.barrier()  # the data has reached the host buffer by now
    before = buf.sum().item()
    work.wait()
    return [before, float((buf - x * 7).abs().max()), float(host_staged(buf))]


@pytest.mark.timeout(60)
def test_point_to_point_through_host_memory():
    before, err, staged = launch(_staged_exchange, 2, backend="gloo", timeout=20, deadline=50)[0]
    assert before == 0.0 and err == 0.0  # written into the tensor at the wait, exactly
    assert staged == 0.0  # a CPU tensor on gloo goes directly


def test_a_hung_part_fails_stops_the_check_and_keeps_what_it_reported(tmp_path):
    """A part that hangs past its own bounds (its workers' supervisor stuck too) must not hold the
    machine: 30 s (here 1 s) past its budget it fails, its JSON keeps what it reported before and
    says why, every process the check started is killed, and the check exits with status 1."""
    code = f"""
import pathlib, subprocess, sys, time
sys.path.insert(0, {str(SCRIPT.parent)!r})
import gpu_check
gpu_check.HARD_GRACE = 1.0
run = gpu_check.Run(100.0, True, pathlib.Path({str(tmp_path)!r}))
def hang(budget):
    run.progress("flagship", sweeps={{"B1": "half done"}})
    child = subprocess.Popen(["sleep", "300"])
    pathlib.Path({str(tmp_path / "child")!r}).write_text(str(child.pid))
    time.sleep(300)
run.part("flagship", 1.0, hang)
print("not reached")
"""
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "not reached" not in p.stdout, p.stdout + p.stderr
    assert time.perf_counter() - t < 60
    part = json.loads((tmp_path / "flagship.json").read_text())
    assert part["status"] == "failed" and "a hang" in part["reason"], part
    assert part["sweeps"] == {"B1": "half done"}
    assert "flagship: FAILED" in (tmp_path / "gpu_check.log").read_text()
    assert "hang" in (tmp_path / "gpu_check.txt").read_text()
    stat = Path(f"/proc/{(tmp_path / 'child').read_text()}/stat")
    deadline = time.time() + 10
    while stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z" and time.time() < deadline:
        time.sleep(0.1)
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", "the part's child still runs"
