"""Random-kill trials of recovery inside the job: the table of ``docs/faults.md`` ("Killing rank 1 with
``kill -9`` at a random moment").

    python benchmarks/random_kill_trials.py --strategy ddp --trials 6
    python benchmarks/random_kill_trials.py --strategy fsdp --trials 6 --seed 1

Each trial is one ``python -m launcher`` command: a 300-step run of the tiny GPT (``SMALL_RUN`` of
``tests/helpers/cli.py``), ``G=4 fault.restarts=1``, validating and checkpointing every 10 steps
(``trainer.val_check_interval=10``, one validation batch). Rank 1 is sent ``SIGKILL`` at a random moment,
3 - 8 s after the four workers are forked (seeded). Printed per trial: the exit code, the recovery's
seconds, step, where the survivors met the loss and where the state came from (``metrics.json``'s
``recoveries``), or the error line of a run that ended (its whole ``stderr.txt`` kept in the trial's
directory); and whether any process of the run is left.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMALL_RUN = ["stages=4", "microbatches=4", "data.batch_size=8", "data.seq_len=8", "data.chars=20000",
             "model.d_model=16", "model.n_head=2", "model.n_layer=2"]


def workers(pid: int) -> dict[int, int]:
    """rank -> pid of the launcher's workers (each is named ``launcher-rank<r>``)."""
    out = subprocess.run(["ps", "-o", "pid=,comm=", "--ppid", str(pid)], capture_output=True, text=True,
                         check=False).stdout
    found = (re.fullmatch(r"\s*(\d+)\s+launcher-rank(\d+)\s*", line) for line in out.splitlines())
    return {int(m[2]): int(m[1]) for m in found if m}


def left(marker: str) -> list[str]:
    """Processes still running whose command line mentions ``marker`` (the trial's directory)."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=False).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


def trial(run: Path, strategy: str, steps: int, every: int, delay: float) -> dict:
    args = [*SMALL_RUN, f"strategy={strategy}", "G=4", "fault.restarts=1", f"trainer.max_steps={steps}",
            f"trainer.val_check_interval={every}", "trainer.limit_val_batches=1", "logger=none", "png=false",
            f"hydra.run.dir={run}"]
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    p = subprocess.Popen([sys.executable, "-m", "launcher", *args], cwd=run.parent, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    ws: dict[int, int] = {}
    deadline = time.monotonic() + 120
    while len(ws) < 4 and p.poll() is None and time.monotonic() < deadline:
        ws = workers(p.pid)
        time.sleep(0.05)
    forked = time.monotonic()
    if len(ws) == 4:
        time.sleep(max(0.0, forked + delay - time.monotonic()))
        os.kill(ws[1], signal.SIGKILL)
    _, err = p.communicate(timeout=900)
    (run / "stderr.txt").write_text(err)  # the whole of it, for a run that ended
    time.sleep(1)
    row: dict = {"rc": p.returncode, "killed_after_s": round(delay, 2), "left": len(left(str(run)))}
    metrics = run / "metrics.json"
    if metrics.exists():
        recs = json.loads(metrics.read_text()).get("recoveries", [])
        row["recoveries"] = [{k: r.get(k) for k in ("step", "seconds", "during", "from", "steps_lost")} for r in recs]
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    if p.returncode != 0:
        row["error"] = errors[-1] if errors else err[-400:]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategy", default="ddp")
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    work = Path(tempfile.mkdtemp(prefix=f"random_kill_{a.strategy}_"))
    recovered = 0
    for t in range(a.trials):
        row = trial(work / f"trial{t}", a.strategy, a.steps, a.every, rng.uniform(3.0, 8.0))
        recovered += row["rc"] == 0 and bool(row.get("recoveries"))
        print(f"{a.strategy} trial {t}: {json.dumps(row)}", flush=True)
    print(f"{a.strategy}: {recovered} of {a.trials} recovered", flush=True)


if __name__ == "__main__":
    main()
