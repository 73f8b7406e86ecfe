"""Sweeps as Slurm job arrays, against a real single-node Slurm started by tests/slurm/setup.sh
(Debian's slurmctld, slurmd and munge, no systemd). The test cluster keeps no accounting
database, so tests/slurm/bin/sacct answers submitit's polls from ``scontrol``. Skipped, with the
reason, where Slurm cannot be installed or started (not root, no apt-get, no network)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).parent / "slurm"
SMALL = ["G=2", "R=2", "stages=4", "microbatches=4", "data.batch_size=8", "data.seq_len=8", "data.chars=20000",
         "trainer.max_steps=3", "logger=none"]
MODEL = ["+model.seq_len=8", "+model.n_head=2", "+model.n_layer=2"]

DIE = '''
import os

from launcher.models import GPT


class DieGPT(GPT):
    """In a Slurm job with d_model=24, the job's process dies (no result for submitit)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        if kw.get("d_model") == 24 and "SLURM_JOB_ID" in os.environ:
            os._exit(9)
'''


@pytest.fixture(scope="module")
def slurm_env() -> dict[str, str]:
    if os.geteuid() != 0:
        pytest.skip("a test Slurm needs root to install and start its daemons")
    p = subprocess.run(["bash", str(HERE / "setup.sh")], capture_output=True, text=True, timeout=240)
    if p.returncode != 0:
        pytest.skip(f"Slurm could not be set up: {(p.stdout + p.stderr).strip()[-500:]}")
    return dict(os.environ, PATH=f"{HERE / 'bin'}:{os.environ['PATH']}", COLUMNS="250")


def launcher(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher", "-m", "hydra/launcher=slurm", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=280)


def test_sweep_trains_as_one_job_array(slurm_env, tmp_path):
    sweep = tmp_path / "sweep"
    p = launcher("strategy=fslpp,gpipe", *SMALL, "model.d_model=16", "model.n_head=2", "model.n_layer=2",
                 f"hydra.sweep.dir={sweep}", cwd=tmp_path, env=slurm_env)
    assert p.returncode == 0, p.stderr[-3000:]
    script = next(sweep.glob(".submitit/*/*_submission.sh")).read_text()
    assert "#SBATCH --array=0-1" in script
    for n in ("0", "1"):
        m = json.loads((sweep / n / "metrics.json").read_text())
        assert len(m["steps"]) == 3
    assert "sweep: 2 points" in p.stdout and p.stdout.count(" ok ") >= 2


def test_a_job_that_dies_is_a_failed_point_within_a_bounded_time(slurm_env, tmp_path):
    (tmp_path / "die.py").write_text(DIE)
    env = dict(slurm_env, PYTHONPATH=str(tmp_path))
    sweep = tmp_path / "sweep"
    t0 = time.monotonic()
    p = launcher("model=custom", "model._target_=die.DieGPT", *MODEL, "+model.d_model=16,24", "strategy=fslpp",
                 *SMALL, f"hydra.sweep.dir={sweep}", cwd=tmp_path, env=env)
    took = time.monotonic() - t0
    assert p.returncode == 1, p.stderr[-3000:]
    assert took < 120
    table = p.stdout[p.stdout.index("sweep: 2 points"):]
    assert "failed: the job of point 1" in table
    assert "error: 1 of 2 points failed while training" in p.stderr
    assert (sweep / "0" / "metrics.json").exists() and not (sweep / "1" / "metrics.json").exists()
    log = next(sweep.glob(".submitit/*_1/*_1_*log.err"))
    assert "exit code 9" in log.read_text()


def test_slurm_tasks_join_one_group_and_train_like_the_forked_run(slurm_env, tmp_path):
    """tasks_per_node=W: srun starts the W workers (Lightning's SLURMEnvironment) instead of the
    strategy forking them inside one task; the parameters equal a local forked run's (float64)."""
    import torch

    args = ["strategy=fslpp", "G=2", "R=1", "stages=4", "microbatches=2", "data.batch_size=4", "data.seq_len=8",
            "data.chars=20000", "model.d_model=16", "model.n_head=2", "model.n_layer=2", "trainer.max_steps=3",
            "trainer.precision=64-true", "logger=none"]
    sweep, local = tmp_path / "sweep", tmp_path / "local"
    p = launcher("hydra.launcher.tasks_per_node=2", *args, f"hydra.sweep.dir={sweep}", cwd=tmp_path, env=slurm_env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "#SBATCH --ntasks-per-node=2" in next(sweep.glob(".submitit/*/*_submission.sh")).read_text()
    q = subprocess.run([sys.executable, "-m", "launcher", *args, f"hydra.run.dir={local}"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=200)
    assert q.returncode == 0, q.stderr[-3000:]
    a = torch.load(sweep / "0" / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    b = torch.load(local / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-10
