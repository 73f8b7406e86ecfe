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

The store is only touched by the watchdog thread, every ``interval`` seconds, never per job.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

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
        self.aborted: str | None = None
        self._stop = threading.Event()
        self._done = False
        self._thread: threading.Thread | None = None

    # ---- compute-thread side --------------------------------------------------------------
    def set_job(self, job: str) -> None:
        self.job = job
        if self.job_slot is not None:
            self.job_slot.value = job.encode()[: len(self.job_slot) - 1]

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
        self.store.set(f"hb/{self.rank}", f"{self._count}|{self.job}")

    def _poll_abort(self) -> None:
        if self.aborted is None and self.store.check([ABORT_KEY]):
            self.aborted = self.store.get(ABORT_KEY).decode()

    def _run(self) -> None:
        last: dict[int, tuple[str, float]] = {}  # peer -> (heartbeat, when it last changed)
        peers = [r for r in range(self.world_size) if r != self.rank]
        try:
            while not self._stop.wait(self.interval):
                self._beat()
                self._poll_abort()
                if self.aborted is None:
                    now = time.monotonic()
                    for r in peers:
                        key = f"hb/{r}"
                        if r not in last and not self.store.check([key]):
                            continue  # not started yet: the launcher watches start-up
                        hb = self.store.get(key).decode()
                        if hb == "done":
                            continue
                        if r not in last or last[r][0] != hb:
                            last[r] = (hb, now)
                        elif now - last[r][1] > self.timeout:
                            job = hb.split("|", 1)[1]
                            msg = failure_message(r, job, f"no heartbeat for {self.timeout:g} s")
                            self.aborted = self.store.compare_set(ABORT_KEY, "", msg).decode()
                            break
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


_CURRENT: Watchdog | None = None


def current_watchdog() -> Watchdog | None:
    """The watchdog of this process, if a launcher started one."""
    return _CURRENT


def set_current_watchdog(w: Watchdog | None) -> None:
    global _CURRENT
    _CURRENT = w
