"""``python -m launcher.runtime`` is an alias of the Hydra command; torchrun starts the workers
that the strategy then joins (one node here; two nodes in test_multinode)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from helpers.cli import run_launcher
from helpers.training import last_state

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

SMALL = ["strategy=fslpp", "G=2", "R=1", "stages=4", "microbatches=2", "data.batch_size=4", "data.seq_len=8",
         "data.chars=20000", "model.d_model=16", "model.n_head=2", "model.n_layer=2", "trainer.max_steps=3",
         "trainer.precision=64-true", "logger=none"]


#: ``python -m launcher.runtime``, the alias
RUNTIME = (sys.executable, "-m", "launcher.runtime")


def test_alias_trains_and_old_flags_get_one_sentence(tmp_path):
    run = tmp_path / "run"
    p = run_launcher(*SMALL, f"hydra.run.dir={run}", cwd=tmp_path, env=os.environ, command=RUNTIME, timeout=200)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (run / "metrics.json").exists()
    p = run_launcher("--strategy", "fslpp", cwd=tmp_path, env=os.environ, command=RUNTIME, timeout=60)
    assert p.returncode == 2 and p.stderr.splitlines() == [
        "error: --strategy is not an option: python -m launcher.runtime is an alias of python -m launcher and "
        "takes its keys as overrides, e.g. strategy=fslpp G=2 R=2 stages=4 microbatches=4 (see python -m launcher "
        "--help)."]


TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed beside this Python")
def test_torchrun_one_node_and_two_nodes_train_like_the_forked_run(tmp_path):
    forked, one, two = tmp_path / "forked", tmp_path / "one", tmp_path / "two"
    p = run_launcher(*SMALL, f"hydra.run.dir={forked}", cwd=tmp_path, env=os.environ, timeout=200)
    assert p.returncode == 0, p.stderr[-3000:]
    p = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "launcher", *SMALL,
                        f"hydra.run.dir={one}"], cwd=tmp_path, capture_output=True, text=True, timeout=200)
    assert p.returncode == 0, p.stderr[-3000:]
    # two torchrun agents, one per "node", meeting on a loopback rendezvous
    port = _free_port()
    agents = [subprocess.Popen([TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(n),
                                "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "launcher", *SMALL,
                                f"hydra.run.dir={two}"], cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    outs = [a.communicate(timeout=200) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    a = last_state(forked)
    for run in (one, two):
        b = last_state(run)
        assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-12, run
