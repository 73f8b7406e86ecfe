"""One run, a worker lost, four ways: the table of ``docs/faults.md`` ("fault.copies=1 against
checkpoint restart").

    python benchmarks/recovery_table.py                         # fsdp W=4, 40 steps, rank 2 lost at step 25
    python benchmarks/recovery_table.py --strategy fsdp --steps 40 --every 10 --rank 2 --step 25
    python benchmarks/recovery_table.py --slurm --only uninterrupted,slurm   # the Slurm rows, beside the first

The tiny GPT (``d_model=16``, 2 blocks, 4 stages, 4 micro-batches, float32), a checkpoint every
``--every`` steps (``trainer.val_check_interval``, one validation batch; sharded under fsdp), and
rank ``--rank`` sending itself ``SIGKILL`` as step ``--step`` begins (once: a marker file keeps a
resumed run from losing it again). Each row is one ``python -m launcher`` command (or two), timed
wall to wall on this machine:

- ``uninterrupted``: no loss;
- ``fault.copies=1, no loss``: what keeping the copies costs a run that loses nothing;
- ``fault.copies=1``: recovered from the copy on the next worker (``fault.restarts=1``);
- ``fault.copies=0``: recovered from the last sharded checkpoint, the steps since replayed;
- ``fault.replace=true``: a fresh process takes the lost rank (W stays 4), every process resuming
  from a survivor's state in memory (ddp) or the last sharded checkpoint (fsdp);
- ``checkpoint restart``: ``fault.restarts=0``, so the job fails; then ``ckpt_path=.../last.ckpt``
  resumes it in a second command;
- with ``--torchrun``: the same run under ``torchrun --nproc-per-node 4 --max-restarts 1``, without a
  loss and with it (the agent ends every worker and starts them again; they resume from ``last.ckpt``);
- with ``--slurm``: the same run as a Slurm job of 4 tasks (``-m hydra/launcher=slurm
  hydra.launcher.tasks_per_node=4``, on the cluster ``tests/end_to_end/slurm/setup.sh`` starts, its
  ``sacct`` on the PATH), without a loss and with it (a survivor requeues the job, which resumes
  from ``last.ckpt``: :mod:`launcher.lightning.lost_task`); Slurm's hold of a requeued job (its
  ``BeginTime``) is lifted as soon as the job is pending, as on an idle cluster.

Printed: wall seconds, the recovery's seconds and steps lost (``metrics.json``'s ``recoveries``),
and the copies' cost (``metrics.json``'s ``copies``: rank 0's bytes kept and sent per step, and its
seconds per exchange).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOSSY = '''
import os
import signal
from pathlib import Path

from launcher.models import GPT
from launcher.runtime.recovery import current_membership

MARK = Path(os.environ["LOSE_MARK"])


class LossyGPT(GPT):
    def on_train_batch_start(self, batch, batch_idx):
        m = current_membership()
        rank = m.rank if m is not None else int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "-1")))
        if rank == int(os.environ["LOSE_RANK"]) and self.trainer.global_step + 1 == int(os.environ["LOSE_STEP"]) \\
                and not MARK.exists():
            MARK.write_text("lost")
            os.kill(os.getpid(), signal.SIGKILL)
'''


TORCHRUN = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "4",
            "--max-restarts", "1", "-m", "launcher"]


SLURM = [sys.executable, "-m", "launcher", "-m", "hydra/launcher=slurm", "hydra.launcher.tasks_per_node=4"]


def launch(cwd: Path, env: dict[str, str], *args: str, command: list[str] | None = None,
           jobs: Path | None = None) -> tuple[float, int, str]:
    """One command, timed; ``jobs``: its submitit folder, whose pending Slurm jobs are started at once."""
    start = time.monotonic()
    p = subprocess.Popen([*(command or [sys.executable, "-m", "launcher"]), *args], cwd=cwd, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while jobs is not None and p.poll() is None:
        for job in [d.name for d in jobs.glob("*") if d.name.isdigit()]:
            state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%t"], capture_output=True, text=True).stdout
            if state.strip() == "PD":
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True)
        time.sleep(0.3)
    _, err = p.communicate(timeout=900)
    return time.monotonic() - start, p.returncode, err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategy", default="fsdp")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--rank", type=int, default=2)
    ap.add_argument("--step", type=int, default=25)
    ap.add_argument("--only", default="", help="the rows to run: beginnings of their names, comma-separated")
    ap.add_argument("--slurm", action="store_true", help="also as a Slurm job of 4 tasks: uninterrupted, and the "
                    "loss (a survivor requeues the job, which resumes from last.ckpt)")
    ap.add_argument("--torchrun", action="store_true", help="also under torchrun --nproc-per-node 4 --max-restarts 1: "
                    "uninterrupted, and the loss (the agent restarts every worker, which resume from last.ckpt)")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="recovery_table_"))
    (work / "lossy.py").write_text(LOSSY)
    base = ["stages=4", "microbatches=4", "data.batch_size=8", "data.seq_len=8", "data.chars=20000",
            "model=custom", "model._target_=lossy.LossyGPT", "model.vocab_size=128", "model.seq_len=8",
            "model.d_model=16", "model.n_head=2", "model.n_layer=2", f"model.max_steps={a.steps}",
            f"strategy={a.strategy}", "G=4", f"trainer.max_steps={a.steps}", f"trainer.val_check_interval={a.every}",
            "trainer.limit_val_batches=1", "logger=none", "png=false"]
    env = {**os.environ, "PYTHONPATH": str(work), "LOSE_RANK": str(a.rank), "LOSE_STEP": str(a.step)}
    rows = []
    runs = [("uninterrupted", None), ("fault.copies=1, no loss", ["fault.restarts=1", "fault.copies=1"]),
                        ("fault.copies=1", ["fault.restarts=1", "fault.copies=1"]),
                        ("fault.copies=0", ["fault.restarts=1"]),
                        ("fault.replace=true", ["fault.restarts=1", "fault.replace=true"]), ("checkpoint restart", [])]
    if a.torchrun:
        runs += [("torchrun, no loss", ["fault.restarts=1"]), ("torchrun, agent restart", ["fault.restarts=1"])]
    if a.slurm:
        runs += [("slurm, no loss", ["fault.restarts=1"]), ("slurm, requeue", ["fault.restarts=1"])]
    wanted = [w for w in a.only.split(",") if w]
    for name, extra in [r for r in runs if not wanted or r[0].startswith(tuple(wanted))]:
        run = work / name.replace(" ", "_").replace("=", "").replace(",", "")
        mark = work / f"{run.name}.lost"
        if extra is None or "no loss" in name:
            mark.write_text("no loss")
        slurm = name.startswith("slurm")
        where = f"hydra.sweep.dir={run}" if slurm else f"hydra.run.dir={run}"
        wall, rc, err = launch(work, {**env, "LOSE_MARK": str(mark)}, *base, *(extra or []), where,
                               command=TORCHRUN if name.startswith("torchrun") else SLURM if slurm else None,
                               jobs=run / ".submitit" if slurm else None)
        if slurm:
            run = run / "0"
        note = ""
        if name == "checkpoint restart":
            assert rc != 0, "the job was meant to fail"
            again, rc, err = launch(work, {**env, "LOSE_MARK": str(mark)}, *base,
                                    f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"hydra.run.dir={run}_resumed")
            note = f"failed after {wall:.1f} s, resumed in {again:.1f} s"
            wall += again
            run = Path(f"{run}_resumed")
        assert rc == 0, err[-3000:]
        metrics = json.loads((run / "metrics.json").read_text())
        rows.append({"run": name, "wall_s": round(wall, 1), "note": note, "recoveries": metrics.get("recoveries"),
                     "copies": metrics.get("copies")})
        print(json.dumps(rows[-1]), flush=True)
    print(f"runs in {work}")


if __name__ == "__main__":
    main()
