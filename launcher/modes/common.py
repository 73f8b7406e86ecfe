"""What every mode of ``python -m launcher`` shares: the console, the point being run, its run
directory, and how an invalid point is reported (one sentence per rule, ``invalid.json``)."""

from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


def console():
    from rich.console import Console

    # not a terminal (a pipe, a log file): wide enough that the tables never wrap
    return Console(width=None if sys.stdout.isatty() else 200, soft_wrap=False)


def point() -> str:
    try:
        return " ".join(HydraConfig.get().overrides.task) or "(defaults)"
    except ValueError:  # not inside Hydra (tests calling run_config directly)
        return "(config)"


def output_dir() -> Path:
    return Path(HydraConfig.get().runtime.output_dir)


def reject(sentences: list[str], point: str, sweep: bool) -> dict[str, Any]:
    for s in sentences:
        print(f"error: {s}", file=sys.stderr)
    if sweep:
        print(f"skipped: {point} (invalid config; the other points still run)", file=sys.stderr)
    return {"point": point, "ok": False, "errors": sentences}


def write_invalid(cfg: DictConfig, sentences: list[str]) -> None:
    """``invalid.json`` in the run directory: why this run (sweep point) did not run. Never
    raises: the sentences are on stderr already, the file is a record of them."""
    from ..atomic import write_json

    try:
        out = output_dir()
    except ValueError:
        return
    try:
        config: Any = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # an interpolation that cannot resolve: keep it as written
        config = OmegaConf.to_container(cfg, resolve=False)
    try:
        write_json(out / "invalid.json", {"config": config, "errors": sentences})
    except Exception as e:  # noqa: BLE001 - a full disk: say so, in one line, and go on
        from ..atomic import write_sentence

        print(f"error: {write_sentence(out / 'invalid.json', e)}", file=sys.stderr)


#: the file that says which process holds a run directory (its PID)
LOCK_NAME = ".launcher.lock"


class DirInUse(Exception):
    """The run directory is held by another live process; ``str()`` is the one sentence."""


class RunLock:
    """A run's hold on its directory: ``flock`` on ``<dir>/.launcher.lock``, which holds the PID.

    The kernel drops the lock when the holding process ends (however it ends), so a lock file a
    dead run left is taken over by the next run; forked workers share the hold while they live.
    Where the file system has no ``flock``, the PID in the file decides (a live process holds)."""

    def __init__(self, directory: Path, key: str | None = "hydra.run.dir") -> None:
        self.dir, self.key = Path(directory).absolute(), key
        self.path = self.dir / LOCK_NAME
        self.fd: int | None = None
        self.created = False  # the directory was made to hold it (removed again if left empty)

    def _refuse(self, pid: int | None) -> DirInUse:
        who = f"another run (PID {pid})" if pid else "another run"
        if pid and not _alive(pid):  # the launcher died; the workers it forked still hold the directory
            who = f"the workers of a run whose launcher (PID {pid}) has ended"
        if self.key is None:  # a sweep's point: its directory is the sweep's and the point's number
            return DirInUse(f"the run directory {self.dir} is in use by {who}; wait for it to end, or give this sweep "
                            f"its own hydra.sweep.dir.")
        return DirInUse(f"{self.key}={self.dir} is in use by {who}; wait for it to end, or give this run its own "
                        f"{self.key}.")

    def acquire(self) -> "RunLock":
        import fcntl
        import os

        if self.fd is not None:
            return self
        self.created = not self.dir.exists()
        self.dir.mkdir(parents=True, exist_ok=True)
        for _ in range(10):  # another process may remove the file between our open and our lock
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = _pid_in(self.path)
                os.close(fd)
                raise self._refuse(pid) from None
            except OSError:  # no flock here (some network file systems): the PID decides
                os.close(fd)
                pid = _pid_in(self.path)
                if pid and pid != os.getpid() and _alive(pid):
                    raise self._refuse(pid) from None
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # locked a file that was removed meanwhile: lock the new one
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            self.fd = fd
            return self
        raise self._refuse(_pid_in(self.path))

    def release(self) -> None:
        import contextlib
        import os

        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()  # while still held: a waiting run re-opens the new file
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = None
        if self.created:
            with contextlib.suppress(OSError):
                self.dir.rmdir()  # only if nothing else was written there


def _pid_in(path: Path) -> int | None:
    import time

    for _ in range(20):  # the holder writes its PID right after it takes the lock
        try:
            text = path.read_text().strip()
        except OSError:
            return None
        if text.isdigit():
            return int(text)
        time.sleep(0.01)
    return None


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


#: the directories this process holds, by absolute path. Process-wide on purpose: a run directory's
#: lock belongs to the process (flock), and hold() is re-entrant across the command's phases
HELD: dict[Path, RunLock] = {}


def in_use(directory: Path, key: str = "hydra.run.dir") -> str | None:
    """The sentence refusing a run in ``directory`` when another live process holds it; ``None``
    otherwise. Takes nothing and creates nothing (a check before the run's own :func:`hold`)."""
    import fcntl
    import os

    d = Path(directory).absolute()
    path = d / LOCK_NAME
    if d in HELD or not path.exists():
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return str(RunLock(d, key)._refuse(_pid_in(path)))
    except OSError:  # no flock here: the PID decides
        pid = _pid_in(path)
        return str(RunLock(d, key)._refuse(pid)) if pid and pid != os.getpid() and _alive(pid) else None
    finally:
        os.close(fd)  # also drops the shared lock taken to look
    return None


def hold(directory: Path, key: str | None = "hydra.run.dir") -> RunLock:
    """Hold ``directory`` for this run (re-entrant within this process); raises :class:`DirInUse`."""
    d = Path(directory).absolute()
    if d not in HELD:
        HELD[d] = RunLock(d, key).acquire()
    return HELD[d]


def let_go(directory: Path | None = None) -> None:
    """Release ``directory`` (every directory this process holds when ``None``)."""
    for d in [Path(directory).absolute()] if directory is not None else list(HELD):
        lock = HELD.pop(d, None)
        if lock is not None:
            lock.release()


def joined_rank() -> int:
    """This process's rank when torchrun or a Slurm job started one process per worker; 0 otherwise.
    Only rank 0 of such a job holds the run directory (every rank runs this command)."""
    import os

    for var in ("RANK", "SLURM_PROCID"):
        if var == "SLURM_PROCID" and int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
            continue
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def in_sweep() -> bool:
    """Whether this run is one point of a Hydra multirun."""
    try:
        return HydraConfig.get().mode == RunMode.MULTIRUN
    except ValueError:
        return False


#: every file a run leaves as its outcome; a new run in the same directory removes the old ones
OUTCOMES = ("simulation.json", "plan.json", "invalid.json", "pipeline.png")


def clear_outcomes() -> None:
    """Remove an earlier ``mode=simulate`` or ``mode=plan`` run's outcome from the run directory."""
    try:
        out = output_dir()
    except ValueError:  # not inside Hydra
        return
    for name in OUTCOMES:
        (out / name).unlink(missing_ok=True)


#: from this many jobs on, each long phase of a run says what it is doing (on stderr)
PROGRESS_JOBS = 100_000


@contextmanager
def phase(what: str, jobs: int) -> Iterator[None]:
    """Show that a long phase is under way: a live status line on a terminal, otherwise one line
    when it starts and one with its time when it ends (stderr, so stdout stays the report)."""
    if jobs < PROGRESS_JOBS:
        yield
        return
    label = f"{what} ({jobs:,} jobs)"
    t0 = time.perf_counter()
    if sys.stderr.isatty():
        from rich.console import Console

        with Console(stderr=True).status(label + " ..."):
            yield
    else:
        log.info("%s ...", label)
        yield
    log.info("%s: %.1f s", label, time.perf_counter() - t0)


def outcome_of(directory: Path) -> dict[str, Any] | None:
    """The result record of a point read back from its run directory (what the mode returned in
    the process that ran it, for sweeps a remote launcher such as Slurm ran elsewhere); ``None``
    when the point left nothing (it died before writing)."""
    import json

    overrides = directory / ".hydra" / "overrides.yaml"
    where = " ".join(OmegaConf.load(overrides)) if overrides.exists() else directory.name
    if (directory / "metrics.json").exists():
        metrics = json.loads((directory / "metrics.json").read_text())
        if metrics.get("status", "ok") != "ok":  # interrupted: what it measured up to the stop
            return {"point": where, "ok": False, "failed": True, "metrics": metrics,
                    "errors": [metrics.get("error") or f"the run was {metrics.get('status')}"]}
        return {"point": where, "ok": True, "metrics": metrics}
    if (directory / "simulation.json").exists():
        rec = json.loads((directory / "simulation.json").read_text())
        summary = {"workers": rec["workers"], "latency": rec["latency"], "utilization": rec["utilization"],
                   "rho": rec["rho"], "per_worker": rec["per_worker"], "total": rec["totals"]}
        return {"point": where, "ok": True, "summary": summary}
    if (directory / "failed.json").exists():
        err = json.loads((directory / "failed.json").read_text())["error"]
        return {"point": where, "ok": False, "failed": True, "errors": [err]}
    if (directory / "invalid.json").exists():
        return {"point": where, "ok": False, "errors": json.loads((directory / "invalid.json").read_text())["errors"]}
    return None
