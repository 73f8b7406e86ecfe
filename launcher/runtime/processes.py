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
from typing import Any, Callable

import torch
import torch.distributed as dist

from .model import warm_up_meta
from .failure import (ABORT_KEY, DEFAULT_TIMEOUT, HangMonitor, Stop, Watchdog, WorkerAborted, WorkerFailed,
                      failure_message, is_transport_error, set_current_watchdog, transport_reason)

#: how long a blocking collective may take before the backend itself gives up; failure detection
#: is the watchdog's job (a slow but healthy peer keeps beating), so this is generous
PG_TIMEOUT = timedelta(minutes=10)


def auto_backend(backend: str = "auto") -> str:
    """``gloo`` on CPU, ``nccl`` when CUDA is available."""
    if backend != "auto":
        return backend
    return "nccl" if torch.cuda.is_available() else "gloo"


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


def _child(
    rank: int, world: int, backend: str, timeout: float, start_timeout: float, conn, slot, fn: Callable, args: tuple,
    kwargs: dict,
) -> None:
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

    code = 0
    wd = None
    # Ctrl-C reaches the whole foreground process group: the launcher alone handles it (and
    # SIGTERM), stopping every worker with one line instead of a traceback from each
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _name_process(f"launcher-rank{rank}")
    try:
        torch.set_num_threads(1)
        if not conn.poll(start_timeout):
            raise TimeoutError(f"the launcher sent no store address within {start_timeout:g} s")
        port = conn.recv()
        store = dist.TCPStore("127.0.0.1", port, world + 1, False, timedelta(seconds=60))
        # the watchdog gets its own connection: a blocking store call of the group must not delay it
        wd_store = dist.TCPStore("127.0.0.1", port, world + 1, False, timedelta(seconds=60))
        # the launcher looks for silent and hung ranks itself (it sees who died and who is stopped)
        wd = Watchdog(dist.PrefixStore("watchdog", wd_store), rank, world, timeout, job_slot=slot,
                      on_hard_exit=lambda msg: report("aborted", msg), detect=False)
        wd.start()
        set_current_watchdog(wd)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                                timeout=PG_TIMEOUT)
        # everyone has finished gloo's full-mesh connect before anyone can exit and close a pair
        dist.barrier()
        report("started", None)
        result = fn(*args, **kwargs)
        wd.stop(done=True)
        report("ok", result)
    except WorkerAborted as e:
        report("aborted", f"rank {rank} stopped because {e}")
        code = 1
    except BaseException as e:  # noqa: BLE001 - report everything, including KeyboardInterrupt
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
        if own and not transport and not isinstance(e, Stop):  # the culprit's traceback only; never C++ text
            traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # no interpreter teardown: no atexit of the parent's objects, no waiting on a broken group
        os._exit(code)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "auto",
    timeout: float = DEFAULT_TIMEOUT,
    deadline: float | None = None,
    start_timeout: float = 120.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` forked ranks; return each rank's result.

    ``timeout``: how long a worker may go without progress while others wait for it (or without
    a heartbeat) before it is declared hung; it must exceed the longest single job. After a
    failure every worker stops within the watchdog's grace (``min(2, timeout / 4)`` s) plus
    about a second. ``deadline``: optional bound on the whole run. Raises :class:`WorkerFailed`
    naming the failed rank and job.
    """
    backend = auto_backend(backend)
    warm_up_meta()  # once here, inherited by every child, instead of W concurrent imports
    ctx = mp.get_context("fork")
    slots = [ctx.RawArray("c", 256) for _ in range(world_size)]
    procs, conns = [], []
    # fork before the store exists: forking while its server thread holds a lock can leave a child
    # stuck for ever inside gloo's set-up (seen about once in a hundred launches)
    # Children must never garbage-collect what they inherit: a store or process group left over
    # from an earlier launch in this process would join threads that do not exist in the child
    # and abort it. Collect here, where destructors are safe, then freeze the rest across fork.
    gc.collect()
    gc.freeze()
    previous_term = _raise_on_sigterm()
    try:
        for r in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_child, args=(r, world_size, backend, timeout, start_timeout, child_end, slots[r],
                                                 fn, args, kwargs), name=f"launcher-worker-{r}", daemon=True)
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)
    finally:
        gc.unfreeze()
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, True, timedelta(seconds=60), wait_for_workers=False)
    wstore = dist.PrefixStore("watchdog", store)
    for c in conns:
        try:
            c.send(store.port)
        except OSError:
            pass  # that child already died; the loop below reports it

    results: list[Any] = [None] * world_size
    reports: dict[int, tuple[str, Any]] = {}
    failure: str | None = None
    causes: list[str] = []  # what the launcher itself saw fail (deaths, hangs), in order
    stop_by: float | None = None
    # after a failure: the watchdogs see it within an interval, stop within their grace
    interval, grace = min(0.2, timeout / 10), min(2.0, timeout / 4)
    monitor = HangMonitor(timeout)
    next_look = time.monotonic()
    end_by = time.monotonic() + deadline if deadline is not None else None
    start_by: float | None = time.monotonic() + start_timeout
    started: set[int] = set()
    killed: set[int] = set()
    alive = set(range(world_size))
    open_conns = {conns[r]: r for r in range(world_size)}
    sentinels = {procs[r].sentinel: r for r in range(world_size)}

    def take(r: int) -> None:
        c = conns[r]
        try:
            while c.poll():
                kind, payload = pickle.loads(c.recv_bytes())
                if kind != "started":
                    reports[r] = (kind, payload)
        except (EOFError, OSError):
            pass
        open_conns.pop(c, None)

    def set_failure(msg: str) -> None:
        nonlocal failure, stop_by
        if failure is None:
            failure = wstore.compare_set(ABORT_KEY, "", msg).decode()
            stop_by = time.monotonic() + grace + 2 * interval + 2.0

    def look_for_hangs(now: float) -> None:
        """Every rank's heartbeat: a stuck one is named, and killed (it cannot stop itself)."""
        running = [r for r in sorted(alive) if r not in reports]
        try:
            beats = {r: wstore.get(f"hb/{r}").decode() for r in running}
        except Exception:  # noqa: BLE001 - a store hiccup: look again next time
            return
        found = monitor.update(beats, now, jobs={r: slots[r].value.decode() for r in running},
                               stopped=lambda r: _is_stopped(procs[r].pid))
        if found is None:
            return
        r, msg = found
        set_failure(msg)
        if failure == msg:  # nobody failed before it: it is the cause
            causes.append(msg)
            reports[r] = ("failed", msg)
            try:
                os.kill(procs[r].pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    interrupted: Interrupted | None = None
    try:
        while alive:
            now = time.monotonic()
            wait_for = [procs[r].sentinel for r in alive] + list(open_conns)
            watching = failure is None and start_by is None  # every rank started, none failed
            limit = [t - now for t in (stop_by, end_by, start_by, next_look if watching else None) if t is not None]
            ready = mp.connection.wait(wait_for, timeout=max(0.0, min(limit)) if limit else None)
            for obj in ready:
                if obj in open_conns:
                    r = open_conns[obj]
                    try:
                        kind, payload = obj.recv()
                        if kind == "started":
                            started.add(r)
                            if len(started) == world_size:
                                start_by = None
                        else:
                            reports[r] = (kind, payload)
                    except (EOFError, OSError):
                        open_conns.pop(obj, None)
                    continue
                r = sentinels.get(obj)
                if r is None or r not in alive:
                    continue  # a pipe already drained when its process ended
                procs[r].join()
                alive.discard(r)
                take(r)
                kind, payload = reports.get(r, ("died", None))
                if kind == "ok":
                    results[r] = payload
                elif kind in ("failed", "transport"):  # a lost connection is blamed last (see the end)
                    set_failure(payload)
                elif kind == "died":
                    code = procs[r].exitcode
                    how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
                    msg = failure_message(r, slots[r].value.decode(), f"the process died ({how})")
                    reports[r] = ("died", msg)
                    causes.append(msg)
                    set_failure(msg)
                else:  # aborted because of someone else: that one is (or will be) the failure
                    if failure is None and wstore.check([ABORT_KEY]):
                        set_failure(wstore.get(ABORT_KEY).decode())
            now = time.monotonic()
            if failure is None and start_by is None and alive and now >= next_look:
                next_look = now + interval
                look_for_hangs(now)
            if start_by is not None and now >= start_by and failure is None:
                late = sorted(set(range(world_size)) - started)
                set_failure(failure_message(late[0], "", f"ranks {late} did not join the process group within {start_timeout:g} s"))
            if alive and ((stop_by is not None and now >= stop_by) or (end_by is not None and now >= end_by)):
                if failure is None:
                    set_failure(f"the run exceeded its deadline of {deadline} s")
                break
    except (KeyboardInterrupt, Interrupted) as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        interrupted = Interrupted(signum, _where({r: slots[r].value.decode() for r in sorted(alive)}, signum))
    finally:
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)
        # stragglers past the bound, or an interrupted parent: kill them all before joining any,
        # so none has time to see a peer's connection drop and print a traceback about it
        for r in list(alive):
            if procs[r].is_alive():
                os.kill(procs[r].pid, signal.SIGKILL)
                killed.add(r)
        for r in list(alive):
            procs[r].join()
            take(r)
        for c in conns:
            c.close()
    if interrupted is not None:
        raise interrupted
    if failure is not None:
        # a lost connection is the last thing to blame: a death or a hang seen meanwhile comes first
        if failure in {p for k, p in reports.values() if k == "transport"} and causes:
            failure = causes[0]
        errors = {r: str(p) for r, (k, p) in reports.items() if k != "ok"}
        for r in killed:
            errors.setdefault(r, f"rank {r} was killed after not stopping within the bound")
        raise WorkerFailed(failure, errors)
    return results


class Interrupted(BaseException):
    """The launching process got SIGINT or SIGTERM; every worker has been stopped. A
    ``BaseException``, like ``KeyboardInterrupt``, so that no ``except Exception`` on the way up
    (Hydra's job runner, a user's retry loop) mistakes it for a failed run and goes on."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = int(signum)

    @property
    def exit_code(self) -> int:
        """The shell's convention: 128 + the signal number (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + self.signum


def _raise_on_sigterm() -> Any:
    """While workers run, SIGTERM to the launcher stops them like Ctrl-C does; returns the handler
    to restore (None off the main thread, where Python cannot install one)."""

    def handler(signum: int, frame: Any) -> None:
        raise Interrupted(signum, "")

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:
        return None


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
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timedelta(seconds=60))
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run") + "/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    wd = Watchdog(dist.PrefixStore(f"launcher/{run}/watchdog", store), rank, world, timeout).start()
    set_current_watchdog(wd)
    return wd
