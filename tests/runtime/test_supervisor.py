"""The local launcher's supervisor, phase by phase: start -> running -> (stopping) -> done."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from launcher.runtime import WorkerFailed
from launcher.runtime.processes import Supervisor, auto_backend


def rank_squared() -> int:
    return dist.get_rank() ** 2


def fail_on(victim: int) -> None:
    if dist.get_rank() == victim:
        raise ValueError("boom")


def sleep_long() -> None:
    time.sleep(60)


def supervisor(fn, world: int, *args, deadline: float | None = None) -> Supervisor:
    return Supervisor(fn, world, args, {}, backend=auto_backend(), timeout=4.0, deadline=deadline, start_timeout=60.0)


@pytest.mark.timeout(60)
def test_phases_of_a_run_that_succeeds():
    sup = supervisor(rank_squared, 3)
    assert sup.phase == "start"
    sup.start()
    assert sup.phase == "running" and len(sup.procs) == 3 and sup.start_by is not None
    sup.supervise()
    assert sup.phase == "done"
    assert not sup.alive and not sup.killed and sup.failure is None
    assert sup.outcome() == [0, 1, 4]
    assert not any(p.is_alive() for p in sup.procs)


@pytest.mark.timeout(60)
def test_a_failed_rank_is_named_and_everyone_stops():
    sup = supervisor(fail_on, 3, 1)
    sup.start()
    sup.supervise()
    assert sup.phase == "done"
    with pytest.raises(WorkerFailed) as info:
        sup.outcome()
    assert "rank 1 " in str(info.value) and "ValueError: boom" in str(info.value)
    assert not any(p.is_alive() for p in sup.procs)


@pytest.mark.timeout(60)
def test_the_deadline_ends_the_watch_and_kills_the_stragglers():
    sup = supervisor(sleep_long, 2, deadline=3.0)
    sup.start()
    begun = time.monotonic()
    while sup.alive and sup.poll_once():  # what supervise() does, one poll at a time
        pass
    assert sup.phase == "running" and sup.alive
    assert sup.failure == "the run exceeded its deadline of 3.0 s"
    assert time.monotonic() - begun < 10
    sup.stop()
    assert sup.phase == "done" and sup.killed == {0, 1}
    with pytest.raises(WorkerFailed) as info:
        sup.outcome()
    assert "deadline" in str(info.value)
    assert not any(p.is_alive() for p in sup.procs)
