"""Start workers: W local processes (fork), or join a group that torchrun (or Slurm) started.

Local::

    results = launch(train, 4, cfg, timeout=30)      # train(cfg) runs on 4 forked ranks

Each child sets one intra-op thread (2-core machines oversubscribe badly otherwise), joins a
``torch.distributed`` group through a store the parent hosts, starts its :class:`Watchdog`, runs
the function and sends its return value back. The parent watches the children: when one raises or
dies, the store's ``abort`` key names it (and the job it was running), every other child stops
within the watchdog's grace (+ a second or two), stragglers are killed, and :class:`WorkerFailed`
is raised. No child outlives :func:`launch`.

The parent also reads every child's heartbeat (:class:`~launcher.runtime.failure.HangMonitor`): a
child that is stuck (stopped, or hung while its peers wait for it) is named, with its job, within
``timeout`` seconds and killed at once, so the whole run stops within ``timeout`` plus the grace.

With ``restarts`` (``fault.restarts``) a worker that dies or is killed as hung does not end the
run: the parent announces a new generation of the survivors in the store instead of ``abort``,
and they re-form the group and train on (:mod:`.recovery`); the results are then the survivors'.
With ``replace`` (``fault.replace``) the new generation keeps every rank: a *spare*, forked with the
workers through the same :func:`_child` and idle until then, takes the lost rank and joins the
generation's group with the survivors (its store record ``replaced/<generation>`` names the rank).

Which rank is blamed: the one that died without a word (a signal, ``os._exit``), raised, or hung,
whichever the store recorded first. A child whose connection to a peer broke (gloo's "Connection
reset by peer") reports no cause of its own: it waits for that peer's failure to be named, and is
only blamed, last of all and in words, if nobody else is. Only the culprit's own traceback is
printed. Each child is named ``launcher-rank<r>`` for ``ps -o pid,comm``.

torchrun: ``torchrun --nproc-per-node 4 -m launcher strategy=lpp G=2 R=2`` (the Lightning strategy
joins the group itself); for plain Python, :func:`init_from_env` joins it and starts the watchdog.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist

from .. import signals
from ..signals import Interrupted
from ..torch_support.signatures import warm_up_meta
from .failure import (
    ABORT_KEY,
    DEFAULT_TIMEOUT,
    RECOVERY_KEY,
    HangMonitor,
    Stop,
    Watchdog,
    WorkerAborted,
    WorkerFailed,
    failure_message,
    is_transport_error,
    set_current_watchdog,
    transport_reason,
)
from .recovery import Membership, cause_key, recovered_key, rejoin, replaced_key, set_membership

#: how long a blocking collective may take before the backend itself gives up; failure detection
#: is the watchdog's job (a slow but healthy peer keeps beating), so this is generous
PG_TIMEOUT = timedelta(minutes=10)


def auto_backend(backend: str = "auto") -> str:
    """``gloo`` on CPU, ``nccl`` when a CUDA device is visible. Asked of NVML
    (``torch.cuda.device_count``), not of the CUDA driver (``torch.cuda.is_available`` initialises
    it): :func:`launch` forks its workers after this, and a child of a process that initialised
    CUDA cannot use CUDA itself."""
    if backend != "auto":
        return backend
    return "nccl" if torch.cuda.device_count() > 0 else "gloo"


def _name_process(name: str) -> None:
    """What ``ps -o comm`` and ``top`` show for this process (Linux; 15 characters)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except Exception:  # noqa: BLE001 - cosmetic
        pass


def _is_stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, a debugger): state T or t in /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _reporter(rank: int, conn: mp.connection.Connection) -> Callable[[str, Any], None]:
    """``report(kind, payload)``: one message to the launcher over this rank's pipe."""

    def report(kind: str, payload: Any) -> None:
        # plain pickle copies tensors by value; the connection's own pickler would hand over
        # shared-memory handles that die with this process before the launcher reads them
        try:
            data = pickle.dumps((kind, payload))
        except Exception as e:  # noqa: BLE001 - an unpicklable result is this rank's failure
            data = pickle.dumps(("failed", f"rank {rank} could not send its result: {type(e).__name__}: {e}"))
        try:
            conn.send_bytes(data)
        except OSError:
            pass  # the launcher is gone; nobody to tell

    return report


def _connect(world: int, start_timeout: float, conn: mp.connection.Connection) -> tuple[dist.TCPStore, dist.TCPStore]:
    """Two clients of the launcher's store, once it sends the port: the group's, and the watchdog's."""
    if not conn.poll(start_timeout):
        raise TimeoutError(f"the launcher sent no store address within {start_timeout:g} s")
    port = conn.recv()
    store = dist.TCPStore("127.0.0.1", port, world + 1, False, timedelta(seconds=60))
    # the watchdog gets its own connection: a blocking store call of the group must not delay it
    wd_store = dist.TCPStore("127.0.0.1", port, world + 1, False, timedelta(seconds=60))
    return store, wd_store


def _join_group(rank: int, world: int, backend: str, store: dist.TCPStore) -> None:
    """Join the ``torch.distributed`` group through the launcher's store; return once every rank has."""
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                            timeout=PG_TIMEOUT)
    # everyone has finished gloo's full-mesh connect before anyone can exit and close a pair
    dist.barrier()


def _report_failure(rank: int, e: BaseException, wd: Watchdog | None, report: Callable[[str, Any], None]) -> None:
    """Tell the launcher why this rank stops: its own failure, or a peer's. Call inside ``except``."""
    # a broken connection is a peer's failure seen from here: fail() waits for it to be named
    transport = is_transport_error(e)
    if wd is not None:
        msg = wd.fail(e)
    else:
        msg = failure_message(rank, "", f"it lost its connection to another rank ({transport_reason(e)})"
                              if transport else str(e) if isinstance(e, Stop) else f"{type(e).__name__}: {e}")
    own = msg.startswith(f"rank {rank} ")
    if own:
        report("transport" if transport else "failed", msg)
    else:
        report("aborted", f"rank {rank} stopped because {msg}")
    if own and not transport and not isinstance(e, Stop) and not _a_write_error(e):
        traceback.print_exc()  # the culprit's traceback only; never C++ text


def _a_write_error(e: BaseException) -> bool:
    """A file that could not be written (a full disk, a read-only directory): its sentence names the
    file and why (:class:`launcher.atomic.WriteError`); a traceback would add nothing to it."""
    from ..atomic import WriteError

    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, WriteError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _child(
    rank: int | None, world: int, backend: str, timeout: float, start_timeout: float, conn, slots: list, fn: Callable,
    args: tuple, kwargs: dict,
) -> None:
    """One forked rank: join the group, start the watchdog, run ``fn``, report, and exit without teardown.

    ``rank=None``: a spare (``fault.replace``), idle until the launcher sends it a lost worker's rank,
    the recovery's generation and its members; it then joins that generation's group at that rank
    (:func:`~.recovery.rejoin`, as the survivors do) and runs ``fn`` as a replacement
    (:attr:`Membership.replacement`). A spare never needed ends when the launcher does."""
    code = 0
    wd = None
    signals.in_worker()  # the launcher alone handles Ctrl-C, stopping every worker with one line
    joining: tuple[int, list[int]] | None = None
    if rank is None:
        _name_process("launcher-spare")
        try:
            rank, generation, members = conn.recv()
        except (EOFError, OSError):  # the run ended without a loss to replace
            os._exit(0)
        joining = (generation, members)
    report = _reporter(rank, conn)
    _name_process(f"launcher-rank{rank}")
    try:
        torch.set_num_threads(1)
        store, wd_store = _connect(world, start_timeout, conn)
        # the launcher looks for silent and hung ranks itself (it sees who died and who is stopped)
        wd = Watchdog(dist.PrefixStore("watchdog", wd_store), rank, world, timeout, job_slot=slots[rank],
                      on_hard_exit=lambda msg: report("aborted", msg), detect=False)
        if joining is not None:
            wd.generation = joining[0]  # the recovery it joins is no news to it
        wd.start()
        set_current_watchdog(wd)
        if joining is None:
            _join_group(rank, world, backend, store)
            set_membership(Membership(store, backend, rank, list(range(world))))
        else:
            # in the generation before the one it joins: the losses folded into its join count from there
            m = Membership(store, backend, rank, list(joining[1]), generation=joining[0] - 1, replacement=True)
            rejoin(m, wd, joining[0], list(joining[1]), PG_TIMEOUT)
            set_membership(m)
        report("started", None)
        result = fn(*args, **kwargs)
        wd.stop(done=True)
        report("ok", result)
    except WorkerAborted as e:
        report("aborted", f"rank {rank} stopped because {e}")
        code = 1
    except BaseException as e:  # noqa: BLE001 - report everything, including KeyboardInterrupt
        _report_failure(rank, e, wd, report)
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # no interpreter teardown: no atexit of the parent's objects, no waiting on a broken group
        os._exit(code)


#: what :class:`Supervisor` is doing: forking and serving the store, watching the workers, stopping
#: them, or finished (the outcome is known)
Phase = Literal["start", "running", "stopping", "done"]


class Supervisor:
    """The parent's side of :func:`launch`: forks the workers, hosts their store, watches them, stops them.

    One pass through its phases: :meth:`start` (fork, then serve the store), :meth:`supervise`
    (:meth:`poll_once` until every worker has ended or a bound has passed, then :meth:`stop`), and
    :meth:`outcome` (the results, or the error). The first failure seen is written to the store's
    ``abort`` key, where every worker's watchdog reads it.
    """

    def __init__(
        self, fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict, *, backend: str, timeout: float,
        deadline: float | None, start_timeout: float, restarts: int = 0, replace: bool = False,
    ) -> None:
        self.fn, self.world_size, self.args, self.kwargs = fn, world_size, args, kwargs
        self.backend, self.timeout, self.deadline, self.start_timeout = backend, timeout, deadline, start_timeout
        # after a failure: the watchdogs see it within an interval, stop within their grace
        self.interval, self.grace = min(0.2, timeout / 10), min(2.0, timeout / 4)
        self.phase: Phase = "start"
        self.slots: list[Any] = []  # per rank: the job it is running (shared memory the child writes)
        self.procs: list[Any] = []
        self.conns: list[mp.connection.Connection] = []
        self.results: list[Any] = [None] * world_size
        self.reports: dict[int, tuple[str, Any]] = {}
        self.failure: str | None = None
        self.causes: list[str] = []  # what the launcher itself saw fail (deaths, hangs), in order
        self.interrupted: Interrupted | None = None
        self.started: set[int] = set()
        self.killed: set[int] = set()
        self.alive = set(range(world_size))
        self.monitor = HangMonitor(timeout)
        self.open_conns: dict[mp.connection.Connection, int] = {}  # pipes not yet drained -> rank
        self.sentinels: dict[int, int] = {}  # process sentinel -> rank
        self.store: dist.TCPStore | None = None
        self.wstore: dist.PrefixStore | None = None
        # time.monotonic() bounds; the first three are set once every worker has its port
        self.next_look = 0.0
        self.start_by: float | None = None
        self.end_by: float | None = None
        self.stop_by: float | None = None
        self._previous_term: dict[int, Any] = {}
        # recovery (:mod:`.recovery`): lost workers still to recover from, the generation, its
        # members (original ranks, in new-rank order), the ranks lost, and the bound on the
        # survivors' joining the generation's group
        self.restarts = restarts
        self.generation = 0
        self.members = list(range(world_size))
        self.lost: set[int] = set()
        self.recoveries: list[dict[str, Any]] = []
        self.rejoin_by: float | None = None
        # fault.replace: the spares forked with the workers (one per restart), each with its pipe, and
        # the processes of lost ranks that a spare replaced (joined when the run ends)
        self.replace = replace
        self.spares: list[tuple[Any, mp.connection.Connection]] = []
        self.retired: list[Any] = []

    # ---- start -------------------------------------------------------------------------------

    def start(self) -> None:
        """Fork every worker, then host the store and send each its port; the clocks start after."""
        warm_up_meta()  # once here, inherited by every child, instead of W concurrent imports
        self._fork()
        self._serve_store()
        now = time.monotonic()
        self.next_look = now
        self.end_by = now + self.deadline if self.deadline is not None else None
        self.start_by = now + self.start_timeout
        self.phase = "running"

    def _fork(self) -> None:
        """One child per rank, each with its pipe and job slot; SIGTERM stops them like Ctrl-C from here on."""
        ctx = mp.get_context("fork")
        self.slots = [ctx.RawArray("c", 256) for _ in range(self.world_size)]
        # fork before the store exists: forking while its server thread holds a lock can leave a child
        # stuck for ever inside gloo's set-up (seen about once in a hundred launches)
        # Children must never garbage-collect what they inherit: a store or process group left over
        # from an earlier launch in this process would join threads that do not exist in the child
        # and abort it. Collect here, where destructors are safe, then freeze the rest across fork.
        gc.collect()
        gc.freeze()
        self._previous_term = signals.while_supervising()
        try:
            for r in range(self.world_size):
                parent_end, child_end = ctx.Pipe(duplex=True)
                p = ctx.Process(target=_child, args=(r, self.world_size, self.backend, self.timeout, self.start_timeout,
                                                     child_end, self.slots, self.fn, self.args, self.kwargs),
                                name=f"launcher-worker-{r}", daemon=True)
                p.start()
                child_end.close()
                self.procs.append(p)
                self.conns.append(parent_end)
            # spares fork now too: forking later, while the store's server thread runs, risks the hang above
            for i in range(self.restarts if self.replace else 0):
                parent_end, child_end = ctx.Pipe(duplex=True)
                p = ctx.Process(target=_child, args=(None, self.world_size, self.backend, self.timeout,
                                                     self.start_timeout, child_end, self.slots, self.fn, self.args,
                                                     self.kwargs), name=f"launcher-spare-{i}", daemon=True)
                p.start()
                child_end.close()
                self.spares.append((p, parent_end))
        finally:
            gc.unfreeze()
        self.open_conns = {self.conns[r]: r for r in range(self.world_size)}
        self.sentinels = {self.procs[r].sentinel: r for r in range(self.world_size)}

    def _serve_store(self) -> None:
        """Host the store (only now that no fork is to come) and send every child its port."""
        self.store = dist.TCPStore("127.0.0.1", 0, self.world_size + 1, True, timedelta(seconds=60),
                                   wait_for_workers=False)
        self.wstore = dist.PrefixStore("watchdog", self.store)
        for c in self.conns:
            try:
                c.send(self.store.port)
            except OSError:
                pass  # that child already died; the loop below reports it

    # ---- running -----------------------------------------------------------------------------

    def supervise(self) -> None:
        """Watch until every worker has ended, one failed and the rest had their grace, or the deadline
        passed; Ctrl-C or SIGTERM ends the watch as :class:`Interrupted`. Stops every worker before returning."""
        try:
            while self.alive and self.poll_once():
                pass
        except (KeyboardInterrupt, Interrupted) as e:
            signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
            self.interrupted = Interrupted(signum, _where({r: self._job(r) for r in sorted(self.alive)}, signum))
        finally:
            self.stop()

    def poll_once(self) -> bool:
        """Wait for a message, an exit or the next check, and act on it; False once a bound has passed."""
        ready = mp.connection.wait([self.procs[r].sentinel for r in self.alive] + list(self.open_conns),
                                   timeout=self._wait_timeout(time.monotonic()))
        for obj in ready:
            if obj in self.open_conns:
                self._receive(obj)
                continue
            r = self.sentinels.get(obj) if isinstance(obj, int) else None  # the rest: process sentinels
            if r is None or r not in self.alive:
                continue  # a pipe already drained when its process ended
            self._on_exit(r)
        return self._check(time.monotonic())

    def _wait_timeout(self, now: float) -> float | None:
        """Until the nearest bound, or the next look at the heartbeats while every rank runs."""
        watching = self.failure is None and self.start_by is None  # every rank started, none failed
        limit = [t - now for t in (self.stop_by, self.end_by, self.start_by, self.next_look if watching else None)
                 if t is not None]
        return max(0.0, min(limit)) if limit else None

    def _recover(self, r: int, msg: str) -> bool:
        """Rank ``r`` is lost (``msg`` says how): with a restart left and survivors to go on, announce
        the next generation without it (the survivors re-form the group and train on; also while they
        are re-forming it after an earlier loss), or with a spare in its place (``replace``), and return
        True; else False (the caller ends the run as before)."""
        survivors = [m for m in self.members if m != r and m in self.alive and m not in self.reports]
        replacing = self.replace and bool(self.spares) and bool(survivors) and r in self.members
        if self.rejoin_by is not None and self.failure is None:
            # the last recovery may be over though this loop has not looked yet: look now, so a loss
            # soon after it is a new loss, not one during the recovery
            self._rejoined(time.monotonic())
        if self.failure is not None or self.restarts <= 0 or not survivors:
            return False
        # a loss while the survivors re-form the group (rejoin_by still set) is folded in: the next
        # generation, without it, replaces the one being formed (they wait for each other before
        # forming it, and join the later one, :func:`~.recovery.rejoin`)
        self.restarts -= 1
        self.generation += 1
        self.recoveries.append({"generation": self.generation, "rank": r, "cause": msg,
                                "at": time.monotonic(), "survivors": survivors})
        if replacing:  # every rank stays a member: a spare takes r's place
            self._replace(r)
            assert self.store is not None
            self.store.set(replaced_key(self.generation), str(r))  # before the announcement that it is in
        else:
            self.members = survivors
            self.lost.add(r)
        self.causes.append(msg)
        assert self.store is not None
        self.store.set(cause_key(self.generation), msg)  # before the announcement, as the replaced rank
        self.monitor = HangMonitor(self.timeout)  # the survivors' progress starts afresh
        self.rejoin_by = time.monotonic() + self.timeout + self.grace
        self._watch_store.set(RECOVERY_KEY, f"{self.generation}|{','.join(map(str, self.members))}|{msg}")
        return True

    def _replace(self, r: int) -> None:
        """A spare takes rank ``r``: it is watched from now on in place of the lost process (whose
        exit, if it is still running, a hung one about to be killed, is no news), and is told its
        rank, the generation and its members, then the store's port."""
        proc, conn = self.spares.pop(0)
        old = self.procs[r]
        self.sentinels.pop(old.sentinel, None)
        self.open_conns.pop(self.conns[r], None)
        self.retired.append(old)
        self.conns[r].close()
        self.procs[r], self.conns[r] = proc, conn
        self.sentinels[proc.sentinel] = r
        self.open_conns[conn] = r
        self.alive.add(r)
        self.reports.pop(r, None)
        self.slots[r].value = b""
        assert self.store is not None
        try:
            conn.send((r, self.generation, list(self.members)))
            conn.send(self.store.port)
        except OSError:
            pass  # the spare died: its sentinel says so next, a loss like any other

    def _rejoined(self, now: float) -> None:
        """Whether every survivor joined the generation's group; past the bound, the run ends."""
        assert self.store is not None and self.rejoin_by is not None
        keys = [recovered_key(self.generation, m) for m in self.members]
        try:
            joined = self.store.check(keys)
        except Exception:  # noqa: BLE001 - a store hiccup: look again next time
            joined = False
        if joined:
            self.recoveries[-1]["rejoined_s"] = now - self.recoveries[-1]["at"]
            self.rejoin_by = None
        elif now >= self.rejoin_by:
            self._set_failure(f"{self.recoveries[-1]['cause']}; the survivors did not re-form the group within "
                              f"{self.timeout + self.grace:g} s")

    def _receive(self, conn: mp.connection.Connection) -> None:
        """One message from a running rank: it joined the group, or its report."""
        r = self.open_conns[conn]
        try:
            kind, payload = conn.recv()
            if kind == "started":
                self.started.add(r)
                if len(self.started) == self.world_size:
                    self.start_by = None
            else:
                self.reports[r] = (kind, payload)
        except (EOFError, OSError):
            self.open_conns.pop(conn, None)

    @property
    def _watch_store(self) -> dist.PrefixStore:
        """The watchdog's keys of the store (served from :meth:`start` on)."""
        assert self.wstore is not None
        return self.wstore

    def _on_exit(self, r: int) -> None:
        """Rank ``r``'s process ended: keep its result, or name the failure its report (or silence) tells of."""
        self.procs[r].join()
        self.alive.discard(r)
        self._take(r)
        if r in self.lost:  # a hung rank killed and recovered from: its exit is no news
            return
        kind, payload = self.reports.get(r, ("died", None))
        if kind == "ok":
            self.results[r] = payload
        elif kind in ("failed", "transport"):  # a lost connection is blamed last (see outcome())
            self._set_failure(payload)
        elif kind == "died":
            code = self.procs[r].exitcode
            how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
            msg = failure_message(r, self._job(r), f"the process died ({how})")
            self.reports[r] = ("died", msg)
            if not self._recover(r, msg):
                self.causes.append(msg)
                self._set_failure(msg)
        else:  # aborted because of someone else: that one is (or will be) the failure
            if self.failure is None and self._watch_store.check([ABORT_KEY]):
                self._set_failure(self._watch_store.get(ABORT_KEY).decode())
            elif self.failure is None and self.recoveries and r in self.members:
                # a survivor that stopped where it could not recover (outside a training step):
                # the run ends, blaming the loss it could not recover from
                self._set_failure(f"{self.recoveries[-1]['cause']}; rank {r} could not recover from it ({payload})")

    def _check(self, now: float) -> bool:
        """The timed decisions: a hang, ranks late to start, the grace or the deadline spent (False)."""
        if self.failure is None and self.start_by is None and self.alive and now >= self.next_look:
            self.next_look = now + self.interval
            if self.rejoin_by is not None:
                self._rejoined(now)
            self._look_for_hangs(now)
        if self.start_by is not None and now >= self.start_by and self.failure is None:
            late = sorted(set(range(self.world_size)) - self.started)
            self._set_failure(failure_message(
                late[0], "", f"ranks {late} did not join the process group within {self.start_timeout:g} s"))
        if self.alive and ((self.stop_by is not None and now >= self.stop_by)
                           or (self.end_by is not None and now >= self.end_by)):
            if self.failure is None:
                self._set_failure(f"the run exceeded its deadline of {self.deadline} s")
            return False
        return True

    def _look_for_hangs(self, now: float) -> None:
        """Every rank's heartbeat: a stuck one is named, and killed (it cannot stop itself)."""
        running = [r for r in sorted(self.alive) if r not in self.reports]
        try:
            beats = {r: self._watch_store.get(f"hb/{r}").decode() for r in running}
        except Exception:  # noqa: BLE001 - a store hiccup: look again next time
            return
        found = self.monitor.update(beats, now, jobs={r: self._job(r) for r in running},
                                    stopped=lambda r: _is_stopped(self.procs[r].pid))
        if found is None:
            return
        r, msg = found
        pid = self.procs[r].pid  # (a replacement takes procs[r] in _recover)
        if self._recover(r, msg):  # kill it; the survivors go on without it, or with a replacement
            os.kill(pid, signal.SIGKILL)
            return
        self._set_failure(msg)
        if self.failure == msg:  # nobody failed before it: it is the cause
            self.causes.append(msg)
            self.reports[r] = ("failed", msg)
            try:
                os.kill(self.procs[r].pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _set_failure(self, msg: str) -> None:
        """The first failure wins, here and in the store (a worker's watchdog may have named one first)."""
        if self.failure is None:
            self.failure = self._watch_store.compare_set(ABORT_KEY, "", msg).decode()
            self.stop_by = time.monotonic() + self.grace + 2 * self.interval + 2.0

    def _take(self, r: int) -> None:
        """Whatever rank ``r`` sent before its pipe closed."""
        c = self.conns[r]
        try:
            while c.poll():
                kind, payload = pickle.loads(c.recv_bytes())
                if kind != "started":
                    self.reports[r] = (kind, payload)
        except (EOFError, OSError):
            pass
        self.open_conns.pop(c, None)

    def _job(self, r: int) -> str:
        """What rank ``r`` is running (its slot), or ``""`` between jobs."""
        return self.slots[r].value.decode()

    # ---- stopping, done ----------------------------------------------------------------------

    def stop(self) -> None:
        """Kill every worker still running, then join them all and close the pipes."""
        self.phase = "stopping"
        signals.restore(self._previous_term)
        self._previous_term = {}
        # stragglers past the bound, or an interrupted parent: kill them all before joining any,
        # so none has time to see a peer's connection drop and print a traceback about it
        started = [r for r in sorted(self.alive) if r < len(self.procs)]  # all of them, unless the fork failed
        for r in started:
            if self.procs[r].is_alive():
                os.kill(self.procs[r].pid, signal.SIGKILL)
                self.killed.add(r)
        for r in started:
            self.procs[r].join()
            self._take(r)
        for p in [*self.retired, *(p for p, _ in self.spares)]:  # replaced (killed already) and unused spares
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join()
        for c in [*self.conns, *(c for _, c in self.spares)]:
            c.close()
        self.phase = "done"

    def outcome(self) -> list[Any]:
        """Each rank's result (after a recovery: each survivor's, in the order of their new ranks);
        raises :class:`Interrupted`, or :class:`WorkerFailed` naming the culprit."""
        if self.interrupted is not None:
            raise self.interrupted
        if self.failure is None:
            return [self.results[m] for m in self.members]
        failure = self.failure
        # a lost connection is the last thing to blame: a death or a hang seen meanwhile comes first
        if failure in {p for k, p in self.reports.values() if k == "transport"} and self.causes:
            failure = self.causes[0]
        errors = {r: str(p) for r, (k, p) in self.reports.items() if k != "ok"}
        for r in self.killed:
            errors.setdefault(r, f"rank {r} was killed after not stopping within the bound")
        raise WorkerFailed(failure, errors)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "auto",
    timeout: float = DEFAULT_TIMEOUT,
    deadline: float | None = None,
    start_timeout: float = 120.0,
    restarts: int = 0,
    replace: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` forked ranks; return each rank's result.

    ``timeout``: how long a worker may go without progress while others wait for it (or without
    a heartbeat) before it is declared hung; it must exceed the longest single job. After a
    failure every worker stops within the watchdog's grace (``min(2, timeout / 4)`` s) plus
    about a second. ``deadline``: optional bound on the whole run. Raises :class:`WorkerFailed`
    naming the failed rank and job. ``restarts``: how many lost workers (died, or hung and killed)
    the run recovers from instead (:mod:`.recovery`; ``fn`` must re-form the group itself, as
    :class:`~launcher.lightning.UnifiedStrategy` does); the results are then the survivors'.
    ``replace``: each such loss is taken by a fresh process for the lost rank instead (a spare forked
    with the workers), which ``fn`` must bring into the run (:mod:`launcher.lightning.replacement`).
    """
    supervisor = Supervisor(fn, world_size, args, kwargs, backend=auto_backend(backend), timeout=timeout,
                            deadline=deadline, start_timeout=start_timeout, restarts=restarts, replace=replace)
    try:
        supervisor.start()
    except BaseException:  # a stop (SIGTERM, Ctrl-C) or a store that failed between the fork and the watch
        supervisor.stop()
        raise
    supervisor.supervise()
    return supervisor.outcome()


def _where(jobs: dict[int, str], signum: int) -> str:
    """One line: which signal, and where the workers still running were when it came."""
    busy = [(r, j) for r, j in jobs.items() if j]
    name = signal.Signals(signum).name
    if not jobs:
        return f"stopped by {name}"
    if not busy:
        return f"stopped by {name} between steps; all {len(jobs)} workers stopped"
    shown = ", ".join(f"rank {r} in {j}" for r, j in busy[:3]) + (", ..." if len(busy) > 3 else "")
    return f"stopped by {name}: {shown}; all {len(jobs)} workers stopped"


def init_from_env(backend: str = "auto", timeout: float = DEFAULT_TIMEOUT) -> Watchdog:
    """Join the process group torchrun (or any ``env://`` launcher) describes, with a watchdog.

    torchrun's agent already stops every worker when one exits with an error; the watchdog adds
    the error that names the failed rank and its job, and stops a worker whose peer hangs.
    """
    backend = auto_backend(backend)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=PG_TIMEOUT)
    dist.barrier()  # as in launch(): no rank leaves while another is still connecting
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False,
                          timedelta(seconds=60))
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run") + "/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    wd = Watchdog(dist.PrefixStore(f"launcher/{run}/watchdog", store), rank, world, timeout).start()
    set_current_watchdog(wd)
    return wd
