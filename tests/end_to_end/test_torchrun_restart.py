"""``fault.restarts`` under ``torchrun``: its agent ends every worker when one dies (so no survivor
is left to recover inside the job), and with ``--max-restarts`` starts them all again; the run then
resumes from its ``last.ckpt`` (:mod:`launcher.lightning.elastic`) and ends with the parameters of
an uninterrupted run. One node, 4 workers, float64; rank 2 sends itself ``SIGKILL`` as step 4 of 6
begins, the last checkpoint being step 2's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.cli import SMALL_RUN, run_launcher, survivors
from helpers.faults import lossy_gpt
from helpers.training import last_state

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")



@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed beside this Python")
def test_torchrun_ends_every_worker_then_its_restart_resumes_from_last_ckpt(tmp_path: Path) -> None:
    (tmp_path / "lossy.py").write_text(lossy_gpt("RANK"))
    overrides = [*SMALL_RUN, "model=custom", "model._target_=lossy.LossyGPT", "model.vocab_size=128",
                 "model.seq_len=8", "model.max_steps=6", "strategy=fsdp", "G=4", "trainer.max_steps=6",
                 "trainer.precision=64-true", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
                 "logger=none", "png=false", "fault.restarts=1"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "LOSE_RANK": "2", "LOSE_STEP": "4",
           "LOSE_MARK": str(tmp_path / "lost")}
    forked, run = tmp_path / "forked", tmp_path / "run"
    p = run_launcher(*overrides, f"hydra.run.dir={forked}", cwd=tmp_path, env={**env, "LOSE_RANK": "-1"},
                     timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    start = time.monotonic()
    p = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "4", "--max-restarts", "1", "-m", "launcher",
                        *overrides, f"hydra.run.dir={run}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    wall = time.monotonic() - start
    assert p.returncode == 0, p.stderr[-3000:]
    # the agent, not the launcher, handled the loss: it sent SIGTERM to the three survivors
    assert len(re.findall(r"Sending process \d+ closing signal SIGTERM", p.stderr)) == 3, p.stderr[-3000:]
    assert "its --max-restarts=1: the workers start again and resume from the run's last.ckpt" in p.stdout
    assert p.stdout.count(f"torchrun: restart 1 of the workers (a worker was lost); resuming from "
                          f"{run / 'checkpoints' / 'last.ckpt'}") == 4, p.stdout[-3000:]
    a, b = last_state(forked), last_state(run)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"torchrun, fsdp W=4, rank 2 lost at step 4 of 6: restarted and resumed from step 2 in {wall:.1f} s "
          f"wall; last.ckpt within {diff:.1e} of the uninterrupted run")
    assert a.keys() == b.keys() and diff < 1e-12
    assert not survivors(str(run))
