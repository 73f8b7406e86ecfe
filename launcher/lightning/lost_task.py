"""A lost Slurm task: the job is requeued, and resumes from the run's ``last.ckpt``.

With ``hydra.launcher.tasks_per_node=W`` Slurm starts the workers (``srun``, one task each), not
the launcher: when a task dies, the others see its connection break and their watchdogs name the
loss within ``timeout`` s (:mod:`launcher.runtime.failure`), but no launcher is left that could
re-form the group (``fault.restarts`` inside the job is the local launcher's). So with
``fault.restarts=N`` the first survivor to meet a *loss* (a task that died or hung, not a peer's
own Python error, which would fail again) asks Slurm to requeue the job (``scontrol requeue``, as
the warning path does: :mod:`.requeue`) and ends without a result; the requeued job runs the same
Hydra job in the same run directory and resumes from its ``checkpoints/last.ckpt``, as a torchrun
restart does (:mod:`.elastic`). A survivor meets the loss either in the training code (an exception
up to ``launcher.modes.train``) or in its watchdog's hard stop (a survivor stuck in a collective,
or the store gone with rank 0): both ask here, and one lock makes it once per process.

Each requeue is written down in the run directory, ``requeued/<attempt>.json`` (the attempt is
``SLURM_RESTART_COUNT``): created exclusively by the survivor that requeues, so W-1 survivors ask
Slurm once; completed by the requeued job's rank 0 at its first step (:class:`ResumeTimes`); read
into ``metrics.json``'s ``recoveries`` (:func:`recoveries`). Their number is what ``fault.restarts``
bounds: a loss after N requeues ends the job as without them. Times are wall-clock
(``time.time()``): the loss (when a survivor first saw a broken connection, else when its watchdog
named the loss), the requeue, and the requeued job's first step.

Slurm's defaults are assumed: ``srun`` without ``--kill-on-bad-exit`` (``KillOnBadExit=0``), so the
survivors live on after a task dies, and a batch job that may be requeued (``JobRequeue=1``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NoReturn

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from ..atomic import write_json
from ..runtime.failure import current_watchdog
from .requeue import slurm_job

log = logging.getLogger(__name__)

#: the folder of the run directory that records each requeue after a lost task
FOLDER = "requeued"
#: how the watchdogs word a lost process (died, hung, or the store's host gone), as opposed to a
#: peer's own Python error (``rank r failed while running j: ValueError: ...``), which a requeue
#: would only meet again
LOSS = re.compile(r"no heartbeat for|: it hung|store became unreachable|lost its connection to another rank")
#: how long a survivor that has requeued the job waits for Slurm to end it before exiting itself
LEAVE_S = 120.0


def under_slurm_tasks() -> bool:
    """Whether Slurm started this worker as one of several tasks of a job step (``srun``)."""
    return "SLURM_JOB_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1


def attempt() -> int:
    """How many times Slurm has requeued this job (``SLURM_RESTART_COUNT``; 0 on its first run)."""
    value = os.environ.get("SLURM_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def fallback_note(restarts: int) -> str | None:
    """The console line for ``fault.restarts`` when Slurm started the workers; ``None`` elsewhere."""
    if not restarts or not under_slurm_tasks():
        return None
    return (f"slurm: a lost task ends the job step (Slurm started the workers), so fault.restarts={restarts} is "
            f"served by requeueing the job (up to {restarts} time{'s' if restarts > 1 else ''}): it resumes from the "
            f"run's last.ckpt")


def is_loss(cause: str) -> bool:
    """Whether ``cause`` (a watchdog's or a worker's failure sentence) is a lost task."""
    return bool(LOSS.search(cause))


def _records(out: Path) -> list[tuple[Path, dict[str, Any]]]:
    found = []
    for p in sorted((Path(out) / FOLDER).glob("*.json"), key=lambda p: int(p.stem) if p.stem.isdigit() else -1):
        try:
            found.append((p, json.loads(p.read_text())))
        except (OSError, ValueError):  # being written by the survivor that claimed it
            found.append((p, {}))
    return found


def pending(out: str | Path) -> dict[str, Any] | None:
    """The requeue this job resumes after: the newest record, of this job, not yet resumed from."""
    if not under_slurm_tasks() or attempt() == 0:
        return None
    found = _records(Path(out))
    if not found:
        return None
    record = found[-1][1]
    return record if record.get("job") == slurm_job() and "resumed_at" not in record else None


def resume_path(out: str | Path) -> Path | None:
    """The checkpoint a job requeued after a lost task resumes from: the run directory's ``last.ckpt``
    (``None`` before the run's first checkpoint: the job then starts afresh)."""
    last = Path(out) / "checkpoints" / "last.ckpt"
    return last if pending(out) is not None and last.exists() else None


def forget(out: str | Path) -> None:
    """A run into ``out`` keeps the requeues of its own job only (a job requeued again, after a time
    limit say, keeps those it already resumed from); an earlier run's are not its own."""
    job = slurm_job() if under_slurm_tasks() and attempt() > 0 else None
    for p, record in _records(Path(out)):
        if record.get("job") != job:
            p.unlink(missing_ok=True)


@dataclass
class _Armed:
    out: Path
    restarts: int
    trainer: Trainer
    label: str
    workers: int
    outcome: bool | None = None  # requeued (by this process or another survivor), or not


_armed: _Armed | None = None
_lock = threading.Lock()


@contextlib.contextmanager
def armed(out: Path, restarts: int, trainer: Trainer, label: str, workers: int) -> Iterator[None]:
    """While training runs in a Slurm task with ``restarts``: a lost task requeues the job."""
    global _armed
    if restarts <= 0 or not under_slurm_tasks():
        yield
        return
    _armed = _Armed(Path(out), restarts, trainer, label, workers)
    try:
        yield
    finally:
        _armed = None


def requeued(cause: str) -> bool:
    """After a failure met while training (``cause``, one sentence): True when the job is being
    requeued (by this survivor, or by another that claimed it first); False when it ends as
    without ``fault.restarts``: not armed, not a lost task, requeues used up, or Slurm refused."""
    with _lock:
        run = _armed
        if run is None:
            return False
        if run.outcome is None:
            run.outcome = _requeue(run, cause.removeprefix(f"rank {os.environ.get('SLURM_PROCID', '?')} stopped "
                                                           f"because "))
        return run.outcome


def _requeue(run: _Armed, cause: str) -> bool:
    if not is_loss(cause):
        return False
    folder = run.out / FOLDER
    mine = folder / f"{attempt()}.json"
    done = [p for p, _ in _records(run.out) if p != mine]
    if mine.exists():
        return True  # another survivor of this attempt asks Slurm
    if len(done) >= run.restarts:
        log.error("slurm: the job was requeued %d time%s after lost tasks already (fault.restarts=%d): it ends here",
                  len(done), "" if len(done) == 1 else "s", run.restarts)
        return False
    folder.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(mine, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return True
    watchdog = current_watchdog()
    seen = getattr(watchdog, "broken_at", None)
    # the rank a watchdog named; "lost its connection" names the survivor that saw it, not the lost one
    lost = [] if "lost its connection" in cause else [int(r) for r in re.findall(r"^rank (\d+) failed", cause)]
    record: dict[str, Any] = {
        "requeue": len(done) + 1, "job": slurm_job(), "attempt": attempt(), "cause": cause, "lost_ranks": lost,
        "step": run.trainer.global_step + 1, "detected_by": int(os.environ.get("SLURM_PROCID", "0")),
        "scheme": run.label, "workers": run.workers, "lost_at": seen if seen is not None else time.time()}
    write_json(mine, record)
    log.warning("slurm: %s; requeueing the job (%d of fault.restarts=%d): it resumes from %s", cause, len(done) + 1,
                run.restarts, run.out / "checkpoints" / "last.ckpt")
    p = subprocess.run(["scontrol", "requeue", slurm_job()], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        mine.unlink(missing_ok=True)
        log.error("slurm: scontrol requeue %s failed (%s): the job ends here", slurm_job(),
                  " ".join((p.stderr or p.stdout).split()) or f"exit {p.returncode}")
        return False
    record["requeued_at"] = time.time()
    write_json(mine, record)
    return True


def on_hard_exit(message: str) -> None:
    """The watchdog's hard stop of a survivor (:class:`~launcher.runtime.failure.Watchdog`): the
    same requeue, before the process ends."""
    try:
        requeued(message)
    except Exception as e:  # noqa: BLE001 - the process ends next either way: say why, do not raise in the watchdog
        log.error("slurm: the requeue after %s failed: %s", message, e)


def leave() -> NoReturn:
    """End a survivor of a requeued job without a result (submitit would read one as the job's)."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(LEAVE_S)  # Slurm ends the job step of a requeued job
    sys.exit(1)


class ResumeTimes(Callback):
    """In a job requeued after a lost task: rank 0 completes the requeue's record at the first step
    (the step resumed from, the steps lost, the seconds from the loss) and says so."""

    def __init__(self, out: str | Path) -> None:
        self.out = Path(out)
        self.record: dict[str, Any] | None = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.record = pending(self.out) if trainer.global_rank == 0 else None

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        r, self.record = self.record, None
        if r is None:
            return
        now = time.time()
        r.update(resumed_at=now, resumed_step=trainer.global_step,
                 steps_lost=max(0, r["step"] - 1 - trainer.global_step), seconds=round(now - r["lost_at"], 3))
        write_json(self.out / FOLDER / f"{r['attempt']}.json", r)
        requeued_at = r.get("requeued_at", r["lost_at"])
        log.warning("slurm: resumed at step %d after the requeue, %.1f s after the loss (%.1f s to the requeue, %.1f s "
                    "from the requeue to this step); %d step%s lost and replayed, and step %d redone",
                    trainer.global_step + 1, r["seconds"], requeued_at - r["lost_at"], now - requeued_at,
                    r["steps_lost"], "" if r["steps_lost"] == 1 else "s", r["step"])


def recoveries(out: str | Path) -> list[dict[str, Any]]:
    """Each requeue after a lost task that the run resumed from, as an entry of ``metrics.json``'s
    ``recoveries`` (the fields of :mod:`.recovery`'s, and the requeue's own times)."""
    found = []
    for _, r in _records(Path(out)):
        if "resumed_at" not in r:
            continue
        requeued_at = r.get("requeued_at", r["lost_at"])
        found.append({
            "generation": r["requeue"], "cause": r["cause"], "lost_ranks": r["lost_ranks"], "step": r["step"],
            "seconds": r["seconds"], "steps_lost": r["steps_lost"], "redone": 1, "during": "the Slurm job step",
            "from": "last.ckpt (the job requeued)", "scheme_before": r["scheme"], "scheme_after": r["scheme"],
            "chosen_by": "slurm requeue", "workers": [r["workers"], r["workers"]],
            "requeue": {"job": r["job"], "resumed_step": r["resumed_step"],
                        "to_requeue_s": round(requeued_at - r["lost_at"], 3),
                        "requeue_to_step_s": round(r["resumed_at"] - requeued_at, 3)}})
    return found
