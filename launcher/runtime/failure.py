"""Failure handling: when one worker raises or dies, every other worker stops, naming it.

Each worker runs a :class:`Watchdog` thread next to its compute. It talks to a key-value store
shared by the group (the launcher's, or torchrun's agent store):

- it publishes a heartbeat with the job the worker is running (``hb/<rank>``);
- a worker whose own code raises records the first failure under ``abort`` (first writer wins);
  the local launcher does the same for a worker that dies without a word (killed, segfault);
- every watchdog polls ``abort`` and the peers' heartbeats; on an abort, or a peer whose heartbeat
  has not moved for ``timeout`` seconds, it flags the worker. The compute thread checks the flag
  between operations and raises :class:`WorkerAborted`. A compute thread stuck inside a blocking
  collective gets ``grace`` seconds, then the watchdog reports and ends the process itself, so a
  worker stops within ``timeout + grace`` of a failure whatever it was doing.

A worker can also hang: its process lives and its watchdog beats, but its compute thread is stuck
(a data function that sleeps, a deadlock in user code). So the heartbeat also carries the compute
thread's *progress* (a counter it moves at every job and at the end of every wait for a peer) and
whether it is *waiting* for a peer right now (:meth:`Watchdog.blocked`). The rule: when some rank
is waiting and no rank's progress has moved for ``timeout`` seconds, the ranks that are neither
waiting nor done are hung, and the lowest is named with the job it was running. Why this rule:

- a slow job is not a hang while anyone else still moves (other ranks' jobs, messages arriving);
- ranks that all work outside the engine (loading data, saving a checkpoint, evaluating) are not
  waiting for one another, so however long that takes, nothing is flagged;
- what it cannot tell apart is one job that alone takes longer than ``timeout`` while every other
  rank waits for it: ``timeout`` must exceed the longest single job (and the longest time one
  rank spends outside the engine while the others already wait for it in the next step).

The store is only touched by the watchdog thread, every ``interval`` seconds, never per job.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator

import torch.distributed as dist

DEFAULT_TIMEOUT = 30.0  # seconds: how long a silent peer may go before it is declared dead

ABORT_KEY = "abort"


class WorkerAborted(RuntimeError):
    """Raised in a worker that stops because another worker failed; the message names it."""


class WorkerFailed(RuntimeError):
    """Raised by the launcher when a worker failed; ``errors`` holds what each rank reported."""

    def __init__(self, message: str, errors: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or {}


def failure_message(rank: int, job: str, what: str) -> str:
    """The one sentence every worker reports: which rank, which job, what happened."""
    return f"rank {rank} failed while running {job or 'no job (between steps)'}: {what}"


class Watchdog:
    """Heartbeat, abort flag and hard stop for one worker (see the module docstring)."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout: float = DEFAULT_TIMEOUT,
        interval: float | None = None,
        grace: float | None = None,
        job_slot=None,
        on_hard_exit: Callable[[str], None] | None = None,
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout = float(timeout)
        self.interval = interval if interval is not None else min(0.2, self.timeout / 10)
        self.grace = grace if grace is not None else min(2.0, self.timeout / 4)
        self.job_slot = job_slot  # shared memory the local launcher reads if this process dies
        self.on_hard_exit = on_hard_exit
        self.job = ""
        self.progress = 0  # moved by the compute thread at every job and every finished wait
        self.waiting = False  # the compute thread is blocked waiting for a peer
        self.aborted: str | None = None
        self._stop = threading.Event()
        self._done = False
        self._thread: threading.Thread | None = None

    # ---- compute-thread side --------------------------------------------------------------
    def set_job(self, job: str) -> None:
        self.job = job
        self.progress += 1
        if self.job_slot is not None:
            self.job_slot.value = job.encode()[: len(self.job_slot) - 1]

    @contextmanager
    def blocked(self) -> Iterator[None]:
        """Mark the compute thread as waiting for a peer (a receive, a collective) meanwhile."""
        self.waiting = True
        try:
            yield
        finally:
            self.waiting = False
            self.progress += 1

    def check(self) -> None:
        """Raise :class:`WorkerAborted` if another worker failed."""
        if self.aborted is not None:
            raise WorkerAborted(self.aborted)

    def fail(self, exc: BaseException) -> str:
        """Record this worker's own failure for the others; returns the message."""
        msg = failure_message(self.rank, self.job, f"{type(exc).__name__}: {exc}")
        try:
            return self.store.compare_set(ABORT_KEY, "", msg).decode()
        except Exception:  # the store may be gone with the group; the launcher still sees our exit
            return msg

    def wait_abort(self, seconds: float) -> str | None:
        """After a communication error: give the watchdog up to ``seconds`` to name the culprit."""
        deadline = time.monotonic() + seconds
        while self.aborted is None and time.monotonic() < deadline:
            self._poll_abort()
            if self.aborted is None:
                time.sleep(0.02)
        return self.aborted

    # ---- the thread -----------------------------------------------------------------------
    def start(self) -> "Watchdog":
        self._beat()
        self._thread = threading.Thread(target=self._run, name=f"watchdog-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def stop(self, done: bool = True) -> None:
        """Stop watching; ``done`` tells the peers this worker finished cleanly (its silence is fine)."""
        self._stop.set()
        if done and not self._done:
            self._done = True
            try:
                self.store.set(f"hb/{self.rank}", "done")
            except Exception:
                pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(1.0, 2 * self.interval))

    def _beat(self) -> None:
        self._count = getattr(self, "_count", 0) + 1
        self.store.set(f"hb/{self.rank}", f"{self._count}|{self.progress}|{int(self.waiting)}|{self.job}")

    def _check_hang(self, state: dict[int, tuple[int, bool, str]]) -> None:
        msg = hang_message(state, self.timeout)
        if msg is not None:
            self.aborted = self.store.compare_set(ABORT_KEY, "", msg).decode()

    def _poll_abort(self) -> None:
        if self.aborted is None and self.store.check([ABORT_KEY]):
            self.aborted = self.store.get(ABORT_KEY).decode()

    def _run(self) -> None:
        last: dict[int, tuple[str, float]] = {}  # peer -> (heartbeat, when it last changed)
        peers = [r for r in range(self.world_size) if r != self.rank]
        moved: dict[int, int] = {}  # rank -> its progress when last seen
        moved_at = time.monotonic()  # when any rank's progress last moved
        try:
            while not self._stop.wait(self.interval):
                self._beat()
                self._poll_abort()
                if self.aborted is None:
                    now = time.monotonic()
                    # rank -> (progress, waiting, job) of every rank still running, this one too
                    state = {self.rank: (self.progress, self.waiting, self.job)}
                    for r in peers:
                        key = f"hb/{r}"
                        if r not in last and not self.store.check([key]):
                            continue  # not started yet: the launcher watches start-up
                        hb = self.store.get(key).decode()
                        if hb == "done":
                            continue
                        _, progress, waiting, job = hb.split("|", 3)
                        state[r] = (int(progress), waiting == "1", job)
                        if r not in last or last[r][0] != hb:
                            last[r] = (hb, now)
                        elif now - last[r][1] > self.timeout:
                            msg = failure_message(r, job, f"no heartbeat for {self.timeout:g} s")
                            self.aborted = self.store.compare_set(ABORT_KEY, "", msg).decode()
                            break
                    if self.aborted is None:
                        if any(moved.get(r) != p for r, (p, _, _) in state.items()):
                            moved_at = now
                        moved = {r: p for r, (p, _, _) in state.items()}
                        if now - moved_at > self.timeout:
                            self._check_hang(state)
                if self.aborted is not None:
                    break
        except Exception as e:  # the store went away: whoever hosted it is gone
            if self._stop.is_set():
                return
            self.aborted = f"the group's store became unreachable ({type(e).__name__}: {e}); a worker or the launcher died"
        if self.aborted is None or self._stop.is_set():
            return
        # give the compute thread a chance to raise on its own, then stop the process ourselves
        if self._stop.wait(self.grace):
            return
        msg = f"rank {self.rank} stopped because {self.aborted}"
        if self.on_hard_exit is not None:
            try:
                self.on_hard_exit(msg)
            except Exception:
                pass
        print(msg, file=sys.stderr, flush=True)
        os._exit(1)


def hang_message(state: dict[int, tuple[int, bool, str]], timeout: float) -> str | None:
    """The failure when no rank has moved for ``timeout`` s (``state``: rank -> (progress,
    waiting, job) of the ranks still running): the lowest rank that is not waiting is hung, if
    any rank waits; ``None`` when nobody waits (everyone is busy outside the engine)."""
    waiting = sorted(r for r, (_, w, _) in state.items() if w)
    if not waiting:
        return None
    hung = sorted(r for r, (_, w, _) in state.items() if not w)
    if not hung:  # impossible by construction of the plan; say so rather than wait for gloo
        r = waiting[0]
        return failure_message(r, state[r][2], f"every rank ({waiting}) has waited for another for {timeout:g} s (deadlock)")
    r = hung[0]
    return failure_message(
        r, state[r][2], f"it hung: no progress for {timeout:g} s while rank{'s' if len(waiting) > 1 else ''} "
        f"{', '.join(map(str, waiting))} waited for it")


def blocked(watchdog: Watchdog | None):
    """``watchdog.blocked()``, or nothing without a watchdog: wrap every wait for a peer in it."""
    return nullcontext() if watchdog is None else watchdog.blocked()


_CURRENT: Watchdog | None = None


def current_watchdog() -> Watchdog | None:
    """The watchdog of this process, if a launcher started one."""
    return _CURRENT


def set_current_watchdog(w: Watchdog | None) -> None:
    global _CURRENT
    _CURRENT = w
