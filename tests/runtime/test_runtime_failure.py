"""Failure handling: when a worker dies or raises mid-step, every other worker stops within the
bound with an error naming the failed rank and its job; no process is left; no partial checkpoint."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from launcher.runtime import Engine, WorkerFailed, launch, mlp_batches, staged_mlp
from launcher.runtime.failure import Watchdog
from launcher.schedule import make_schedule

TIMEOUT = 4.0
BOUND = TIMEOUT + min(2.0, TIMEOUT / 4) + 1.0 + 2.0  # launcher's stop bound, plus slack for a loaded machine


def train_and_fail(tmp: str, how: str, victim: int, steps: int = 4, transport: str = "gloo") -> None:
    rank = dist.get_rank()
    Path(tmp, f"pid-{rank}").write_text(str(os.getpid()))
    engine = Engine(staged_mlp(4), make_schedule("gpipe", 4, 4, G=1, R=4), lambda ps: torch.optim.SGD(ps, lr=0.1),
                    transport=transport)
    if rank == victim:
        stage = engine.modules[victim]
        inner = stage.forward
        calls = []

        def forward(x):
            if engine.steps == 2:
                calls.append(1)
                if len(calls) == 2:  # the second micro-batch of step 2, mid-step for everyone
                    Path(tmp, "failed-at").write_text(str(time.time()))
                    if how == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    raise ValueError("boom")
            return inner(x)

        stage.forward = forward
    for i in range(steps):
        engine.train_step(mlp_batches(4, seed=i))
        engine.save_checkpoint(Path(tmp, f"ckpt-{i + 1}.pt"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["gloo", "shm"])
@pytest.mark.parametrize("how", ["kill", "raise"])
def test_failure_stops_everyone(tmp_path, how, transport):
    """Over gloo or over shared memory (a peer's closed link, or the watchdog, ends the waits)."""
    victim = 2
    with pytest.raises(WorkerFailed) as info:
        launch(train_and_fail, 4, str(tmp_path), how, victim, 4, transport, timeout=TIMEOUT, deadline=100)
    done = time.time()
    err = info.value
    # the job: F of stage 2, micro-batch 1, step 2 (gpipe: rank 2 runs stage 2)
    culprit = f"rank {victim} failed while running F(2,1) of step 2"
    assert culprit in str(err), str(err)
    assert ("SIGKILL" if how == "kill" else "ValueError: boom") in str(err)
    for r in (0, 1, 3):
        assert culprit in err.errors.get(r, ""), f"rank {r} reported {err.errors.get(r)!r}"
    assert done - float((tmp_path / "failed-at").read_text()) < BOUND
    for r in range(4):  # nothing left behind
        pid = int((tmp_path / f"pid-{r}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # step 1 finished and was saved; step 2 failed: no checkpoint, not even a partial one
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt"))
    assert names == ["ckpt-1.pt"], names
    assert len(torch.load(tmp_path / "ckpt-1.pt")["stages"]) == 4


@pytest.mark.timeout(60)
def test_watchdog_names_a_silent_peer():
    """Without a launcher (torchrun, Slurm), a peer that stops beating is named within the timeout."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    a = Watchdog(dist.PrefixStore("t", store), 0, 2, timeout=1.0, interval=0.05, grace=30.0)
    b = Watchdog(dist.PrefixStore("t", store), 1, 2, timeout=1.0, interval=0.05, grace=30.0)
    try:
        a.start()
        b.set_job("B(3,1) of step 7")
        b.start()
        time.sleep(0.3)
        b.stop(done=False)  # silent from now on, as if frozen or killed
        t0 = time.monotonic()
        while a.aborted is None and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        assert a.aborted is not None and time.monotonic() - t0 < 3.0
        assert "rank 1 failed while running B(3,1) of step 7: no heartbeat" in a.aborted
    finally:
        a.stop()


@pytest.mark.timeout(60)
def test_finished_peer_is_not_a_failure():
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    a = Watchdog(dist.PrefixStore("t", store), 0, 2, timeout=0.5, interval=0.05, grace=30.0)
    b = Watchdog(dist.PrefixStore("t", store), 1, 2, timeout=0.5, interval=0.05, grace=30.0)
    try:
        a.start()
        b.start()
        b.stop(done=True)
        time.sleep(1.2)
        assert a.aborted is None
    finally:
        a.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("others", ["busy", "waiting"])
def test_a_write_longer_than_the_timeout_is_not_a_hang(others):
    """Every rank writing its checkpoint shard at once for longer than the timeout, or one writing
    while the other waits for it, is work: neither a deadlock nor a hung rank. The same wait
    without the write is still named (the rule the other tests hold)."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    a = Watchdog(dist.PrefixStore("t", store), 0, 2, timeout=0.5, interval=0.05, grace=30.0)
    b = Watchdog(dist.PrefixStore("t", store), 1, 2, timeout=0.5, interval=0.05, grace=30.0)
    try:
        a.start()
        b.start()
        with a.busy(), (b.busy() if others == "busy" else b.blocked()):
            time.sleep(1.5)  # three timeouts
        assert a.aborted is None and b.aborted is None
        with b.blocked():  # rank 0 neither busy nor progressing: hung
            t0 = time.monotonic()
            while a.aborted is None and b.aborted is None and time.monotonic() - t0 < 5:
                time.sleep(0.05)
        assert "rank 0 failed" in (a.aborted or b.aborted or "") and "it hung" in (a.aborted or b.aborted or "")
    finally:
        a.stop()
        b.stop()
