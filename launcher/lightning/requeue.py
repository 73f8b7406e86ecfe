"""Slurm's warning before a time limit or a preemption: checkpoint at the next step, then requeue.

Slurm sends the warning (``--signal=USR2@60`` in the ``hydra/launcher=slurm`` preset; Lightning's
documented ``--signal=SIGUSR1@90`` works too) to every process of the job step: the launching
process and each worker it forked, or each task ``srun`` started. Lightning's own Slurm handler
saves its checkpoint inside the signal handler; with the stages spread over workers that would
start the collective gather at a different point of the step on each worker, so here the handler
only raises a flag. After every training step the workers agree on it (one all-reduce), save
Lightning's HPC checkpoint (``hpc_ckpt_N.ckpt`` in the run directory, from which Lightning resumes
by itself when the requeued job starts: :func:`resume_path`) and stop. The launching process then
requeues the job (:func:`requeue`): through submitit's handler when submitit started the job (it
resubmits the same Hydra job, in the same directory), else with ``scontrol requeue`` as Lightning
does.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from typing_extensions import override

from .. import signals
from .lightning_private import hpc_save_path

log = logging.getLogger(__name__)

#: the HPC checkpoints Lightning writes and resumes from (``hpc_ckpt_<N>.ckpt``)
HPC = re.compile(r"hpc_ckpt_(\d+)\.ckpt$")

# the warning signals this process got (a forked worker has its own copy). Module state on purpose: a
# signal handler is process-wide and takes no context, and the callback in each forked worker reads it
_received: list[int] = []


def in_slurm_job() -> bool:
    return "SLURM_JOB_ID" in os.environ


def slurm_job() -> str:
    """This job's id as ``scontrol`` takes it: ``<array job>_<task>`` for an array task."""
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ["SLURM_JOB_ID"]


def warning_signals() -> list[signal.Signals]:
    """submitit's preemption signal (``SUBMITIT_PREEMPT_SIGNAL``, USR2 by default) and Lightning's
    requeue signal (USR1)."""
    name = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    first = getattr(signal, f"SIG{name}", None) or getattr(signal, name, None) or signal.SIGUSR2
    return list(dict.fromkeys([signal.Signals(first), signal.SIGUSR1]))


class Watch:
    """While training in a Slurm job, the warning signals raise the flag instead of acting;
    ``previous`` keeps the handlers they replaced (submitit's, which requeues)."""

    def __init__(self) -> None:
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> "Watch":
        _received.clear()
        if in_slurm_job():
            self.previous = signals.slurm_warnings(warning_signals(), _raise_flag)
        return self

    def __exit__(self, *exc: Any) -> None:
        signals.restore(self.previous)

    @property
    def signalled(self) -> int | None:
        return _received[0] if _received else None


def _raise_flag(signum: int, frame: Any) -> None:
    _received.append(signum)


def hpc_checkpoints(folder: str | Path) -> list[Path]:
    """The HPC checkpoints in ``folder``, oldest first."""
    found = [(int(m.group(1)), p) for p in Path(folder).glob("hpc_ckpt_*.ckpt") if (m := HPC.search(p.name))]
    return [p for _, p in sorted(found)]


def resume_path(folder: str | Path) -> Path | None:
    """The checkpoint a requeued job resumes from: the newest HPC checkpoint, inside a Slurm job."""
    found = hpc_checkpoints(folder)
    return found[-1] if found and in_slurm_job() else None


class RequeueOnSignal(Callback):
    """After each training step: if any worker got Slurm's warning, every worker saves the HPC
    checkpoint together and training stops (the launching process requeues the job)."""

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        flag = torch.tensor([1.0 if _received else 0.0])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # all stop after the same step, or none does
        if flag.item() > 0:
            path = hpc_save_path(trainer, trainer.default_root_dir)
            trainer.save_checkpoint(path)  # collective: every stage from its owner
            trainer.should_stop = True
            # stopping ends the epoch early, and checkpoint callbacks would save this step as the
            # epoch's end: without them for the rest of this run, the checkpoints left when the
            # requeued run finishes are those of a run never interrupted
            # Trainer.callbacks is set by Lightning's callback connector, undeclared on the class
            trainer.callbacks = [cb for cb in trainer.callbacks if not isinstance(cb, Checkpoint)]  # type: ignore[attr-defined]


def requeue(watch: Watch, checkpoint: Path) -> NoReturn:
    """Requeue this Slurm job, which saved ``checkpoint``, and end this process without a result."""
    signum = watch.signalled or warning_signals()[0]
    log.warning("slurm: got %s; saved %s; requeueing the job", signal.Signals(signum).name, checkpoint.name)
    previous: Callable | None = watch.previous.get(signum)
    if callable(previous) and type(getattr(previous, "__self__", None)).__module__.startswith("submitit"):
        previous(signum, None)  # submitit: re-dumps its submission, scontrol requeue, exits
    if int(os.environ.get("SLURM_PROCID", "0")) == 0:
        subprocess.run(["scontrol", "requeue", slurm_job()], check=True, timeout=60)
    # Slurm now ends this job step; leave no result behind that would read as finished
    time.sleep(300)
    sys.exit(1)
