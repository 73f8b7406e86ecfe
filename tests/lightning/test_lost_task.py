"""The rules of a requeue after a lost Slurm task (:mod:`launcher.lightning.lost_task`), without a
cluster: which failures are losses, the bound ``fault.restarts`` puts on the requeues, one request
per attempt however many survivors ask, and which records a run resumes after. The requeue itself,
on a real Slurm, is ``tests/end_to_end/test_slurm.py``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from launcher.lightning import lost_task
from launcher.runtime.failure import Watchdog, failure_message, hang_message


@pytest.fixture
def slurm_task(monkeypatch, tmp_path):
    """Task 0 of a 2-task Slurm job 7 after one requeue; no ``scontrol`` on the PATH, so a test
    that reached Slurm would fail."""
    for key, value in {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0",
                       "SLURM_RESTART_COUNT": "1", "PATH": str(tmp_path / "no-bin")}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    return tmp_path / "run"


def _record(out: Path, attempt: int, **extra) -> Path:
    (out / lost_task.FOLDER).mkdir(parents=True, exist_ok=True)
    path = out / lost_task.FOLDER / f"{attempt}.json"
    path.write_text(json.dumps({"requeue": 1, "job": "7", "attempt": attempt, "cause": "rank 1 failed: no heartbeat",
                                "lost_ranks": [1], "step": 4, "scheme": "fsdp G=2 R=1 (W=2)", "workers": 2,
                                "lost_at": 100.0, "requeued_at": 101.0, **extra}))
    return path


def test_the_watchdogs_words_for_a_lost_task_are_losses_and_a_peers_error_is_not():
    store = dist.HashStore()
    silent = Watchdog(store, 0, 2, timeout=0.3)
    store.set("hb/1", "1|0|0|F(1,0)")  # rank 1 beat once, then went silent (killed)
    silent.start()
    deadline = time.monotonic() + 10
    while silent.aborted is None and time.monotonic() < deadline:
        time.sleep(0.05)
    silent.stop()
    lone = Watchdog(dist.HashStore(), 0, 2, timeout=0.1)  # a broken connection nobody names
    cut = lone.fail(RuntimeError("[pair.cc:537] Read error: Connection reset by peer"))
    hung = hang_message({0: (5, True, "B(0,1)"), 1: (3, False, "F(1,1)")}, 5.0)
    assert silent.aborted is not None and "no heartbeat" in silent.aborted
    for sentence in (silent.aborted, cut, hung, f"rank 0 stopped because {silent.aborted}",
                     "the group's store became unreachable (DistNetworkError: Connection reset by peer); a worker or "
                     "the launcher died"):
        assert lost_task.is_loss(str(sentence)), sentence
    assert lone.broken_at is not None  # the loss as the survivor saw it: a requeue's first time
    # a peer's own Python error would fail again after a requeue: the job ends as without restarts
    assert not lost_task.is_loss(failure_message(1, "F(1,0)", "ValueError: the batch has no targets"))


def test_requeues_are_bounded_by_fault_restarts_and_asked_once_per_attempt(slurm_task):
    out, trainer = slurm_task, SimpleNamespace(global_step=3)
    loss = failure_message(1, "", "no heartbeat for 5 s")
    _record(out, 0, resumed_at=120.0, resumed_step=2, steps_lost=1, seconds=20.0)
    with lost_task.armed(out, 1, trainer, "fsdp", 2):  # requeued once already: fault.restarts=1 is used up
        assert not lost_task.requeued(loss)
    with lost_task.armed(out, 0, trainer, "fsdp", 2):  # fault.restarts=0: the job fails, as ever
        assert not lost_task.requeued(loss)
    with lost_task.armed(out, 2, trainer, "fsdp", 2):  # a peer's own error is no lost task
        assert not lost_task.requeued(failure_message(1, "F(1,0)", "ValueError: bad"))
    _record(out, 1)  # another survivor of this attempt claimed the requeue: this one leaves too, asking nothing
    with lost_task.armed(out, 2, trainer, "fsdp", 2):
        assert lost_task.requeued(loss) and lost_task.requeued(loss)
    assert not lost_task.requeued(loss)  # disarmed after training


def test_a_requeued_job_resumes_after_its_own_record_only(slurm_task, monkeypatch):
    out = slurm_task
    _record(out, 0)
    assert lost_task.pending(out)["step"] == 4 and lost_task.resume_path(out) is None  # no checkpoint yet: afresh
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert lost_task.resume_path(out) == out / "checkpoints" / "last.ckpt"
    lost_task.forget(out)  # this job's own requeue stays
    assert lost_task.recoveries(out) == []  # not resumed from yet
    _record(out, 0, resumed_at=121.0, resumed_step=2, steps_lost=1, seconds=21.0)
    lost_task.forget(out)  # resumed from already (the job requeued again, after a time limit): still its own
    [rec] = lost_task.recoveries(out)
    assert (rec["step"], rec["steps_lost"], rec["seconds"], rec["from"]) == (4, 1, 21.0, "last.ckpt (the job requeued)")
    assert rec["requeue"]["to_requeue_s"] == 1.0 and rec["requeue"]["requeue_to_step_s"] == 20.0
    monkeypatch.setenv("SLURM_JOB_ID", "8")  # another job into the same directory: an earlier run's records
    _record(out, 0)
    assert lost_task.pending(out) is None
    lost_task.forget(out)
    assert not list((out / lost_task.FOLDER).iterdir())
