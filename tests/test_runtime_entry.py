"""The runtime's entry point, on local forked workers and under torchrun."""

from __future__ import annotations

import json
import os
import re
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
        (["--backend", "mpi"], "--backend=mpi is not a known backend; use auto, gloo or nccl."),
        (["--backend", "nccl"], "--backend=nccl is invalid here: NCCL needs CUDA GPUs and none is available"),
        (["--lr", "0"], "--lr=0.0 is invalid: the learning rate must be a positive finite number."),
        (["--lr", "-1"], "--lr=-1.0 is invalid"),
        (["--lr", "nan"], "--lr=nan is invalid"),
        (["--lr", "inf"], "--lr=inf is invalid"),
        (["--prefetch", "-1"], "prefetch=-1 is invalid: the prefetch lookahead must be an integer >= 0."),
        (["--timeout", "nan"], "--timeout=nan is invalid"),
        (["--out", "/no/such/dir/steps.json"], "--out=/no/such/dir/steps.json is invalid: its directory /no/such/dir does not exist."),
        (["--out", "."], "--out=. is invalid: it is a directory"),
        (["--model", "no_such_module_xyz:f"],
         "--model=no_such_module_xyz:f is invalid: module no_such_module_xyz cannot be imported (ModuleNotFoundError"),
        (["--model", "launcher.runtime.model"], "--model=launcher.runtime.model is invalid: it must be pkg.mod:name"),
        (["--model", "launcher.runtime.model:nothing"], "--model=launcher.runtime.model:nothing is invalid: module launcher.runtime.model has no nothing"),
        (["--data", "math:pi"], "--data=math:pi is invalid: math.pi is a float, not a callable"),
        (["--model", "launcher.runtime.model:staged_mlp"],
         "--model=launcher.runtime.model:staged_mlp is invalid: launcher.runtime.model.staged_mlp(stages"),
        (["--strategy", "custom"], "--strategy=custom is not available from python -m launcher.runtime: it has no flag "
         "for a custom placement; use the Python API instead, Engine(model, make_step(my_placement"),
        (["--order", "custom"], "--order=custom is not available from python -m launcher.runtime"),
    ],
)
def test_bad_flags_are_refused_before_any_worker_starts(argv, sentence, capsys, monkeypatch):
    from launcher.runtime.__main__ import main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: {sentence}" in err
    assert all(line.startswith("error: ") for line in err.splitlines())  # one sentence per broken rule
    assert not re.search(r"rank \d", err)  # refused up front, not by a failing worker


@pytest.mark.parametrize(
    "world, sentence",
    [("2", "WORLD_SIZE=2 is too small: the step needs W=G*R=2*2=4 workers"),
     ("four", "WORLD_SIZE=four is invalid")],
)
def test_torchrun_world_smaller_than_the_step_is_refused(world, sentence, capsys, monkeypatch):
    from launcher.runtime.__main__ import main

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", world)
    assert main(["--G", "2", "--R", "2"]) == 2  # returns before joining any process group
    assert capsys.readouterr().err.startswith(f"error: {sentence}")


def test_nccl_needs_a_gpu_per_local_worker(capsys, monkeypatch):
    from launcher.runtime.__main__ import main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    assert main(["--G", "2", "--R", "2", "--backend", "nccl"]) == 2
    assert "W=G*R=4 and there are 2 GPUs" in capsys.readouterr().err
