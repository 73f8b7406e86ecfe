"""The runtime's entry point, on local forked workers and under torchrun."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from launcher.runtime import mismatches

ARGS = ["--strategy", "fslpp", "--G", "2", "--R", "1", "--stages", "4", "--microbatches", "2", "--steps", "2",
        "--timeout", "10"]


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; on timeout kill the whole session (torchrun's workers too)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def _check(out) -> None:
    steps = json.loads(out.read_text())
    assert len(steps) == 2
    for rec in steps:
        assert not mismatches(rec)
        assert set(rec["per_worker"]["act_recv"]) == {"predicted", "measured"}


@pytest.mark.timeout(120)
def test_local_entry(tmp_path):
    out = tmp_path / "steps.json"
    r = _run([sys.executable, "-m", "launcher.runtime", *ARGS, "--out", str(out)], 100)
    assert r.returncode == 0, r.stderr
    assert "counts match the simulator" in r.stdout
    _check(out)


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")),
                    reason="torchrun not installed")
def test_torchrun_entry(tmp_path):
    out = tmp_path / "steps.json"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun if os.path.exists(torchrun) else "torchrun", "--standalone", "--nproc-per-node", "2",
           "-m", "launcher.runtime", *ARGS, "--out", str(out)]
    r = _run(cmd, 100)
    assert r.returncode == 0, r.stderr[-3000:]
    _check(out)


@pytest.mark.parametrize(
    "argv, sentence",
    [
        (["--strategy", "ddp", "--G", "2", "--R", "2", "--microbatches", "8"],
         "strategy=ddp needs W = microbatches, but W=G*R=4 and microbatches=8"),
        (["--strategy", "gpipe", "--G", "1", "--R", "4", "--stages", "3"], "R=4 is invalid: R must not exceed stages=3"),
        (["--strategy", "lpp", "--G", "3", "--microbatches", "2"], "G=3 is invalid: G must not exceed microbatches=2"),
        (["--strategy", "lpp", "--order", "zigzag"], "order=zigzag is not a known order"),
        (["--strategy", "lpp", "--steps", "0"], "--steps=0 is invalid"),
    ],
)
def test_bad_flags_are_refused_before_any_worker_starts(argv, sentence, capsys):
    from launcher.runtime.__main__ import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: {sentence}" in err
    assert "rank" not in err  # refused up front, not by a failing worker
