"""Sweeps as Slurm job arrays, against a real single-node Slurm started by tests/end_to_end/slurm/setup.sh
(Debian's slurmctld, slurmd and munge, no systemd). The test cluster keeps no accounting
database, so tests/end_to_end/slurm/bin/sacct answers submitit's polls from ``scontrol``. Skipped, with the
reason, where Slurm cannot be installed or started (not root, no apt-get, no network)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from functools import partial
from pathlib import Path

import pytest

from helpers.cli import LAUNCHER, SMALL_RUN, run_launcher, start_launcher, survivors
from helpers.faults import lossy_gpt
from helpers.training import last_state, load_checkpoint

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

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

SLOW = '''
import os
import time

from launcher.models import CharMLP


class SlowMLP(CharMLP):
    """Takes a while per step, and notes in $PROGRESS the step each (re)start begins at."""

    def _note(self, line):
        if self.trainer.global_rank == 0:
            with open(os.environ["PROGRESS"], "a") as f:
                f.write(line + "\\n")

    def on_train_start(self):
        self._note(f"start {self.trainer.global_step}")

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self._note(f"step {self.trainer.global_step}")
        time.sleep(0.4)
'''


@pytest.fixture(scope="module")
def slurm_env() -> dict[str, str]:
    if os.geteuid() != 0:
        pytest.skip("a test Slurm needs root to install and start its daemons")
    p = subprocess.run(["bash", str(HERE / "setup.sh")], capture_output=True, text=True, timeout=240)
    if p.returncode != 0:
        pytest.skip(f"Slurm could not be set up: {(p.stdout + p.stderr).strip()[-500:]}")
    return dict(os.environ, PATH=f"{HERE / 'bin'}:{os.environ['PATH']}", COLUMNS="250")


#: a sweep through hydra/launcher=slurm; each call passes the Slurm environment (``env=``)
SLURM = (*LAUNCHER, "-m", "hydra/launcher=slurm")
launcher = partial(run_launcher, command=SLURM, timeout=280)


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

    args = ["strategy=fslpp", "G=2", "R=1", "stages=4", "microbatches=2", "data.batch_size=4", "data.seq_len=8",
            "data.chars=20000", "model.d_model=16", "model.n_head=2", "model.n_layer=2", "trainer.max_steps=3",
            "trainer.precision=64-true", "logger=none"]
    sweep, local = tmp_path / "sweep", tmp_path / "local"
    p = launcher("hydra.launcher.tasks_per_node=2", *args, f"hydra.sweep.dir={sweep}", cwd=tmp_path, env=slurm_env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "#SBATCH --ntasks-per-node=2" in next(sweep.glob(".submitit/*/*_submission.sh")).read_text()
    q = run_launcher(*args, f"hydra.run.dir={local}", cwd=tmp_path, env=os.environ, timeout=200)
    assert q.returncode == 0, q.stderr[-3000:]
    assert sorted(p.name for p in (sweep / "0" / "checkpoints").iterdir()) == ["last.ckpt"]
    a = load_checkpoint(sweep / "0" / "checkpoints" / "last.ckpt")["state_dict"]
    b = load_checkpoint(local / "checkpoints" / "last.ckpt")["state_dict"]
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-10


@pytest.mark.parametrize("tasks", [1, 2], ids=["forked-workers", "srun-tasks"])
def test_a_signalled_task_checkpoints_is_requeued_and_ends_like_an_uninterrupted_run(slurm_env, tmp_path, tasks):
    """Slurm's warning (USR2, as --signal=USR2@60 sends it before the time limit) reaches the job
    mid-run: the workers checkpoint after the step they are in, the job is requeued, resumes from
    that checkpoint and ends with the parameters of a run that was never interrupted (float64).
    Both when the task forks its workers and when srun starts them."""

    (tmp_path / "slow.py").write_text(SLOW)
    progress = tmp_path / "progress"
    env = dict(slurm_env, PYTHONPATH=str(tmp_path), PROGRESS=str(progress))
    args = ["model=custom", "model._target_=slow.SlowMLP", "+model.width=16", "+model.n_layer=2", "strategy=fslpp",
            "G=2", "R=1", "stages=4", "microbatches=2", "data.batch_size=4", "data.seq_len=8", "data.chars=20000",
            "trainer.max_steps=12", "trainer.precision=64-true", "logger=none"]
    sweep, local = tmp_path / "sweep", tmp_path / "local"
    sweeping = start_launcher(*args, f"hydra.launcher.tasks_per_node={tasks}", f"hydra.sweep.dir={sweep}",
                              cwd=tmp_path, env=env, command=SLURM, start_new_session=False)
    try:
        deadline = time.monotonic() + 120
        while "step 3" not in (progress.read_text() if progress.exists() else ""):
            assert time.monotonic() < deadline and sweeping.poll() is None, "the job never reached step 3"
            time.sleep(0.2)
        job = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()[0]
        subprocess.run(["scancel", "--signal=USR2", job], check=True)
        # Slurm holds a requeued job back for a while (its BeginTime); on this idle test cluster, let it start now
        while sweeping.poll() is None and "start 3" not in progress.read_text() + "start 4":
            state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%t"], capture_output=True, text=True).stdout
            if state.strip() == "PD":
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True)
                break
            assert time.monotonic() < deadline + 60, "the signalled job was not requeued"
            time.sleep(0.2)
        out, err = sweeping.communicate(timeout=240)
    finally:
        if sweeping.poll() is None:
            sweeping.kill()
    assert sweeping.returncode == 0, err[-3000:]
    starts = [int(line.split()[1]) for line in progress.read_text().splitlines() if line.startswith("start")]
    assert len(starts) == 2 and starts[0] == 0 and starts[1] >= 3, progress.read_text()  # resumed, not restarted
    logs = "".join(p.read_text() for p in sweep.glob(".submitit/*/*log.*"))
    assert "requeueing the job" in logs and "resuming from" in logs
    assert not list((sweep / "0").glob("hpc_ckpt_*.ckpt"))  # finished: nothing left to resume from
    steps = json.loads((sweep / "0" / "metrics.json").read_text())["steps"]
    assert [s["step"] for s in steps] == list(range(1, 13))  # the whole run's curve, across the requeue
    q = run_launcher(*args, f"hydra.run.dir={local}", cwd=tmp_path,
                     env=dict(env, PROGRESS=str(tmp_path / "local-progress")), timeout=200)
    assert q.returncode == 0, q.stderr[-3000:]
    assert sorted(p.name for p in (sweep / "0" / "checkpoints").iterdir()) == ["last.ckpt"]
    a = load_checkpoint(sweep / "0" / "checkpoints" / "last.ckpt")
    b = load_checkpoint(local / "checkpoints" / "last.ckpt")
    assert a["global_step"] == b["global_step"] == 12
    assert max((a["state_dict"][k] - b["state_dict"][k]).abs().max().item() for k in b["state_dict"]) < 1e-10




def test_a_lost_task_requeues_the_job_which_resumes_from_last_ckpt(slurm_env, tmp_path):
    """tasks_per_node=2, fault.restarts=1: task 1 is killed (SIGKILL) as step 4 of 6 begins; the
    survivor names the loss, requeues the job (once) and leaves no result; the requeued job resumes
    from last.ckpt (step 2) and ends with the parameters of a run never interrupted (float64,
    clipping 1.0, dropout, shuffled data), the requeue in metrics.json, nothing left running."""
    (tmp_path / "lossy.py").write_text(lossy_gpt("SLURM_PROCID"))
    env = dict(slurm_env, PYTHONPATH=str(tmp_path), LOSE_RANK="1", LOSE_STEP="4", LOSE_MARK=str(tmp_path / "lost"))
    args = [*SMALL_RUN, "microbatches=2", "model=custom", "model._target_=lossy.LossyGPT", "model.vocab_size=128",
            "model.seq_len=8", "model.max_steps=6", "strategy=fsdp", "G=2", "trainer.max_steps=6",
            "trainer.precision=64-true", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
            "logger=none", "png=false", "fault.restarts=1", "timeout=5"]  # timeout: the loss is named within 5 s
    sweep, local = tmp_path / "sweep", tmp_path / "local"
    t0 = time.monotonic()
    sweeping = start_launcher(*args, "hydra.launcher.tasks_per_node=2", f"hydra.sweep.dir={sweep}", cwd=tmp_path,
                              env=env, command=SLURM, start_new_session=False)
    try:
        while sweeping.poll() is None:  # Slurm holds a requeued job back (its BeginTime): on this idle cluster, not
            for job in [p.name for p in sweep.glob(".submitit/*") if p.name.isdigit()]:
                state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%t"], capture_output=True, text=True).stdout
                if state.strip() == "PD":
                    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True)
            assert time.monotonic() - t0 < 260, "the job did not end"
            time.sleep(0.3)
        out, err = sweeping.communicate(timeout=30)
    finally:
        if sweeping.poll() is None:
            sweeping.kill()
    wall = time.monotonic() - t0
    assert sweeping.returncode == 0, (out + err)[-3000:]
    logs = "".join(p.read_text() for p in sweep.glob(".submitit/*/*log.*"))
    assert "srun: error: localhost: task 1: Killed" in logs
    assert "slurm: rank 1 failed while running" in logs and "requeueing the job (1 of fault.restarts=1)" in logs
    assert f"resuming from {sweep / '0' / 'checkpoints' / 'last.ckpt'}" in logs
    [record] = [json.loads(p.read_text()) for p in (sweep / "0" / "requeued").iterdir()]
    assert (record["lost_ranks"], record["step"], record["resumed_step"], record["steps_lost"]) == ([1], 4, 2, 1)
    metrics = json.loads((sweep / "0" / "metrics.json").read_text())
    [rec] = metrics["recoveries"]
    assert rec["chosen_by"] == "slurm requeue" and rec["seconds"] > 0
    assert [s["step"] for s in metrics["steps"]] == list(range(1, 7))  # the whole curve, across the requeue
    q = run_launcher(*args, f"hydra.run.dir={local}", cwd=tmp_path, env=dict(env, LOSE_RANK="-1"), timeout=200)
    assert q.returncode == 0, q.stderr[-3000:]
    a, b = last_state(sweep / "0"), last_state(local)
    diff = max((a[k] - b[k]).abs().max().item() for k in b)
    print(f"slurm, fsdp W=2 tasks, task 1 lost at step 4 of 6: requeued and resumed from step 2; {wall:.1f} s wall, "
          f"{rec['seconds']} s from the loss to the resumed step ({rec['requeue']}); last.ckpt within {diff:.1e} "
          f"of the uninterrupted run")
    assert a.keys() == b.keys() and diff < 1e-10
    assert not survivors(str(tmp_path))
    assert not subprocess.run(["squeue", "-h", "-o", "%i %o"], capture_output=True, text=True).stdout.count(str(sweep))
