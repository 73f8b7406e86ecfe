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

Under the local launcher (:func:`launcher.runtime.launch`) the launcher applies these rules itself
(:class:`HangMonitor`, with ``detect=False`` here): it hosts the store, sees which processes died
and which are stopped, so it names the rank that is stuck, and kills it, where a peer could only
say "no heartbeat". Under torchrun or Slurm every watchdog applies them.

A communication error (gloo's "Connection reset by peer", a broken NCCL communicator) is never a
cause: it is what a peer sees when the rank at the other end died or stopped. A worker that gets
one does not claim ``abort``; it waits for the cause to be named (:meth:`Watchdog.fail`), and only
if none is named within ``timeout + grace`` reports the lost connection itself, in words, without
the backend's C++ text (:func:`is_transport_error`, :func:`transport_reason`).

When the local launcher recovers from a lost worker instead (``fault.restarts``,
:mod:`.recovery`), it writes ``recovery`` (the generation, the survivors, the cause) rather than
``abort``: the watchdog reads it, :meth:`Watchdog.check` raises :class:`Recovering`, and no hard
stop follows.

The store is only touched by the watchdog thread, every ``interval`` seconds, never per job.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator, NoReturn

import torch.distributed as dist

from ..schedule.run_settings import DEFAULT_RUN

DEFAULT_TIMEOUT = DEFAULT_RUN.timeout  # seconds: how long a silent peer may go before it is declared dead

ABORT_KEY = "abort"
#: where the local launcher announces a recovery (:mod:`.recovery`): ``generation|survivors|cause``
RECOVERY_KEY = "recovery"


class WorkerAborted(RuntimeError):
    """Raised in a worker that stops because another worker failed; the message names it."""


class Recovering(WorkerAborted):
    """Raised in a surviving worker when the launcher recovers from another worker's loss
    (:mod:`.recovery`): the step stops here and is taken up again in the re-formed group."""


class WorkerFailed(RuntimeError):
    """Raised by the launcher when a worker failed; ``errors`` holds what each rank reported."""

    def __init__(self, message: str, errors: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or {}


class Stop(RuntimeError):
    """A stop the user acts on, explained by its message alone: reported without the exception's
    name and without a traceback (a non-finite loss, for example)."""


def failure_message(rank: int, job: str, what: str) -> str:
    """The one sentence every worker reports: which rank, which job, what happened."""
    return f"rank {rank} failed while running {job or 'no job (between steps)'}: {what}"


#: what a communication backend (gloo, NCCL) says when the rank at the other end of
#: a connection died, stopped or closed it: each a consequence of another rank's failure
_TRANSPORT = re.compile(
    r"gloo/transport|connection (?:reset|closed|refused) by peer|Socket Timeout|pair closure|broken pipe|"
    r"NCCL communicator was aborted|nccl(?:Remote|System)Error|remote (?:worker|process) (?:crash|hang|exit)",
    re.IGNORECASE)

_REASONS = (  # (pattern, the words a user reads), first match wins
    (r"connection reset", "the connection was reset"),
    (r"connection closed|closed by peer|disconnected", "the connection was closed"),
    (r"connection refused", "the connection was refused"),
    (r"broken pipe|EPIPE", "the connection broke"),
    (r"time(?:d)? ?out", "a receive timed out"),
)


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in seen and len(seen) < 16:
        seen.append(e)
        e = e.__cause__ or e.__context__
    return seen


def is_transport_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is a communication backend reporting a broken
    connection to a peer: a consequence of another rank's failure, never a cause."""
    if isinstance(exc, WorkerAborted):
        return False
    for e in _chain(exc):
        if isinstance(e, (getattr(dist, "DistNetworkError", ()), getattr(dist, "DistBackendError", ()))):
            return True
        # the backends raise plain RuntimeErrors; a user's own network error (a download) is not one
        if type(e) is RuntimeError and _TRANSPORT.search(str(e)):
            return True
    return False


def transport_reason(exc: BaseException) -> str:
    """A broken connection in words, without the backend's file names, addresses and C++ text."""
    text = " ".join(str(e) for e in _chain(exc))
    for pattern, words in _REASONS:
        if re.search(pattern, text, re.IGNORECASE):
            return words
    return "the connection failed"


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
        detect: bool = True,
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        # look for silent or hung peers; off under the local launcher, which does it for everyone
        self.detect = detect
        self.timeout = float(timeout)
        self.interval = interval if interval is not None else min(0.2, self.timeout / 10)
        self.grace = grace if grace is not None else min(2.0, self.timeout / 4)
        self.job_slot = job_slot  # shared memory the local launcher reads if this process dies
        self.on_hard_exit = on_hard_exit
        self.job = ""
        self.progress = 0  # moved by the compute thread at every job and every finished wait
        self.waiting = False  # the compute thread is blocked waiting for a peer
        self.busy_now = False  # the compute thread is on long work that runs no job (a checkpoint's write)
        self.aborted: str | None = None
        #: when the compute thread first met a broken connection (``time.time()``): the loss as this
        #: worker saw it, before the watchdog named it (a Slurm requeue's times, :mod:`launcher.lightning.lost_task`)
        self.broken_at: float | None = None
        #: the recovery generation this worker has joined, and one the launcher announced since
        #: (``(generation, survivors' original ranks, cause)``; :mod:`.recovery`)
        self.generation = 0
        self.recovery: tuple[int, list[int], str] | None = None
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

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Mark the compute thread as busy meanwhile on long work that runs no job and is no wait
        for a peer (writing a checkpoint): each heartbeat then counts as progress, so a save that
        takes longer than ``timeout`` is not taken for a hang of this rank, nor for a deadlock of
        ranks that all write at once, while the ranks that wait for it still wait."""
        self.busy_now = True
        try:
            yield
        finally:
            self.busy_now = False
            self.progress += 1

    def check(self) -> None:
        """Raise :class:`WorkerAborted` if another worker failed (:class:`Recovering` when the
        launcher recovers from it)."""
        if self.aborted is not None:
            raise WorkerAborted(self.aborted)
        if self.recovery is not None:
            raise Recovering(self.recovery[2])

    def fail(self, exc: BaseException) -> str:
        """Record this worker's own failure for the others; returns the message (another rank's,
        if that one failed first).

        A broken connection (:func:`is_transport_error`) is what a peer's death or hang looks like
        from here: wait up to ``timeout + grace`` for that failure to be named, and return it; only
        if nobody names one is the lost connection recorded, in words."""
        if is_transport_error(exc):
            cause = self.wait_abort(self.timeout + self.grace)
            if cause is not None:
                return cause
            msg = failure_message(self.rank, self.job,
                                  f"it lost its connection to another rank ({transport_reason(exc)}) "
                                  f"and no rank reported a failure within {self.timeout + self.grace:g} s")
        else:
            msg = failure_message(self.rank, self.job,
                                  str(exc) if isinstance(exc, Stop) else f"{type(exc).__name__}: {exc}")
        try:
            return self.store.compare_set(ABORT_KEY, "", msg).decode()
        except Exception:  # the store may be gone with the group; the launcher still sees our exit
            return msg

    def wait_abort(self, seconds: float) -> str | None:
        """After a communication error: give the watchdog up to ``seconds`` to name the culprit."""
        if self.broken_at is None:
            self.broken_at = time.time()
        deadline = time.monotonic() + seconds
        while self.aborted is None and self.recovery is None and time.monotonic() < deadline:
            try:
                self._poll_abort()
            except Exception:  # the store is gone with whoever hosted it: nobody will name a cause
                break
            if self.aborted is None and self.recovery is None:
                time.sleep(0.02)
        if self.aborted is None and self.recovery is not None:
            return self.recovery[2]
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
        if self.busy_now:
            self.progress += 1
        self.store.set(f"hb/{self.rank}", f"{self._count}|{self.progress}|{int(self.waiting)}|{self.job}")

    def _check_hang(self, state: dict[int, tuple[int, bool, str]]) -> None:
        msg = hang_message(state, self.timeout)
        if msg is not None:
            self.aborted = self.store.compare_set(ABORT_KEY, "", msg).decode()

    def _poll_abort(self) -> None:
        if self.aborted is None and self.store.check([ABORT_KEY]):
            self.aborted = self.store.get(ABORT_KEY).decode()
        if self.aborted is None and self.store.check([RECOVERY_KEY]):
            found = parse_recovery(self.store.get(RECOVERY_KEY).decode())
            if found[0] > self.generation and (self.recovery is None or found[0] > self.recovery[0]):
                self.recovery = found

    def _run(self) -> None:
        last: dict[int, tuple[str, float]] = {}  # peer -> (heartbeat, when it last changed)
        peers = [r for r in range(self.world_size) if r != self.rank]
        moved: dict[int, int] = {}  # rank -> its progress when last seen
        moved_at = time.monotonic()  # when any rank's progress last moved
        try:
            while not self._stop.wait(self.interval):
                self._beat()
                self._poll_abort()
                if self.aborted is None and self.detect:
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
            self.aborted = (f"the group's store became unreachable ({type(e).__name__}: {e}); a worker or the "
                            f"launcher died")
        if self.aborted is None or self._stop.is_set():
            return
        # give the compute thread a chance to raise on its own, then stop the process ourselves
        if self._stop.wait(self.grace):
            return
        msg = f"rank {self.rank} stopped because {self.aborted}"
        if self.on_hard_exit is not None:  # the launcher prints the one line for everyone
            try:
                self.on_hard_exit(msg)
            except Exception:
                pass
        else:  # torchrun: a line of our own, in one write so that ranks' lines never interleave
            try:
                sys.stderr.flush()
                os.write(2, (msg + "\n").encode())
            except OSError:
                pass
        os._exit(1)


def parse_recovery(value: str) -> tuple[int, list[int], str]:
    """The store's :data:`RECOVERY_KEY`: ``(generation, survivors' original ranks, cause)``."""
    generation, survivors, cause = value.split("|", 2)
    return int(generation), [int(r) for r in survivors.split(",")], cause


def hang_message(state: dict[int, tuple[int, bool, str]], timeout: float) -> str | None:
    """The failure when no rank has moved for ``timeout`` s (``state``: rank -> (progress,
    waiting, job) of the ranks still running): the lowest rank that is not waiting is hung, if
    any rank waits; ``None`` when nobody waits (everyone is busy outside the engine)."""
    found = hang_culprit(state, timeout)
    return None if found is None else found[1]


def _waited(waiting: list[int]) -> str:
    return f"rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))} waited for it"


def hang_culprit(state: dict[int, tuple[int, bool, str]], timeout: float) -> tuple[int, str] | None:
    """:func:`hang_message`, and the rank it names."""
    waiting = sorted(r for r, (_, w, _) in state.items() if w)
    if not waiting:
        return None
    hung = sorted(r for r, (_, w, _) in state.items() if not w)
    if not hung:  # impossible by construction of the plan; say so rather than wait for gloo
        r = waiting[0]
        return r, failure_message(r, state[r][2],
                                  f"every rank ({waiting}) has waited for another for {timeout:g} s (deadlock)")
    r = hung[0]
    return r, failure_message(r, state[r][2], f"it hung: no progress for {timeout:g} s while {_waited(waiting)}")


class HangMonitor:
    """The local launcher's view of every worker's heartbeat (see the module docstring): feed it
    the heartbeats of the ranks still running, as often as the watchdogs beat; it names a rank that
    is stuck.

    - *frozen*: a rank whose heartbeat has not changed for ``timeout`` s. Its whole process stands
      still (stopped by SIGSTOP or a debugger, or stuck holding the interpreter lock), watchdog
      thread included; a stopped process is named before one that merely does not answer.
    - *hung*: its process lives, but no rank has progressed for ``timeout`` s while some wait:
      :func:`hang_culprit`.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = float(timeout)
        self._seen: dict[int, tuple[str, float]] = {}  # rank -> (heartbeat, when it last changed)
        self._moved: dict[int, int] = {}  # rank -> its progress when last seen
        self._moved_at: float | None = None  # when any rank's progress last moved

    def update(
        self,
        beats: dict[int, str],
        now: float | None = None,
        jobs: dict[int, str] | None = None,
        stopped: Callable[[int], bool] = lambda r: False,
    ) -> tuple[int, str] | None:
        """``beats``: rank -> its heartbeat (``count|progress|waiting|job``, or ``done``) of every
        rank still running; ``jobs``: fresher job labels where known; ``stopped(rank)``: whether its
        process is stopped. Returns ``(rank, one sentence)`` for a stuck rank, else ``None``."""
        now = time.monotonic() if now is None else now
        state: dict[int, tuple[int, bool, str]] = {}
        for r, hb in beats.items():
            if hb == "done":
                continue
            _, progress, waiting, job = hb.split("|", 3)
            state[r] = (int(progress), waiting == "1", (jobs or {}).get(r) or job)
            if r not in self._seen or self._seen[r][0] != hb:
                self._seen[r] = (hb, now)
        if self._moved_at is None or any(self._moved.get(r) != p for r, (p, _, _) in state.items()):
            self._moved_at = now
        self._moved = {r: p for r, (p, _, _) in state.items()}
        frozen = [r for r in state if now - self._seen[r][1] > self.timeout]
        if frozen:
            r = min(frozen, key=lambda q: (not stopped(q), q))
            waiters = sorted(q for q, (_, w, _) in state.items() if w and q not in frozen)
            how = ("its process is stopped (SIGSTOP, or a debugger)" if stopped(r) else
                   "its whole process stopped responding")
            return r, failure_message(r, state[r][2], f"it hung: {how}; no progress for {self.timeout:g} s" +
                                      (f" while {_waited(waiters)}" if waiters else ""))
        if now - self._moved_at > self.timeout:
            return hang_culprit(state, self.timeout)
        return None


def raise_named(watchdog: Watchdog | None, e: Exception) -> NoReturn:
    """Re-raise a communication error (most likely a peer died), named as the failure the
    watchdog learns of within its timeout, if any (:class:`WorkerAborted`), else as it is."""
    if isinstance(e, WorkerAborted):
        raise e
    if watchdog is not None:
        msg = watchdog.wait_abort(watchdog.timeout + watchdog.grace)
        if msg is not None:
            raise WorkerAborted(msg) from e
    raise e


def blocked(watchdog: Watchdog | None):
    """``watchdog.blocked()``, or nothing without a watchdog: wrap every wait for a peer in it."""
    return nullcontext() if watchdog is None else watchdog.blocked()


_CURRENT: Watchdog | None = None


def busy(watchdog: Watchdog | None):
    """``watchdog.busy()``, or nothing without a watchdog: wrap long work that runs no job in it."""
    return nullcontext() if watchdog is None else watchdog.busy()


def current_watchdog() -> Watchdog | None:
    """The watchdog of this process, if a launcher started one."""
    return _CURRENT


def set_current_watchdog(w: Watchdog | None) -> None:
    global _CURRENT
    _CURRENT = w
