"""How a ``mode=train`` run that did not finish is recorded: ``failed.json`` (with the error, the
log and the steps measured before it), or, when stopped by a signal, ``metrics.json`` with what
was measured up to the stop; each one line on stderr, never an exception of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ..config.sentences import one_line
from .common import console


def record_failure(cfg: DictConfig, out: Path, where: str, error: str) -> dict[str, Any]:
    """A point whose training failed: the error on stderr, in the run's log and in ``failed.json``
    (with the log's path and the steps measured before the failure); a sweep goes on with its other
    points. Never raises: a file that cannot be written (a full disk) is said on the same line."""
    import sys

    from ..atomic import write_json, write_sentence
    from ..report import progress

    unwritten: list[str] = []
    log = out / "launcher.log"
    try:
        import logging

        with log.open("a") as f:  # Hydra's job log of this point (its console handler would print it twice)
            f.write(f"[{logging.Formatter().formatTime(logging.makeLogRecord({}))}][launcher][ERROR] - {error}\n")
    except Exception:  # noqa: BLE001 - the log is a copy of the line printed below
        pass
    try:
        try:
            config: Any = OmegaConf.to_container(cfg, resolve=False)
        except Exception:  # noqa: BLE001
            config = None
        steps, val = progress.read(out)
        write_json(out / "failed.json", {"config": config, "status": "failed", "error": error, "log": str(log),
                                         "steps": steps, "val": val})
        progress.remove(out)
    except Exception as e:  # noqa: BLE001 - a full disk: said on the error's line
        unwritten.append(write_sentence(out / "failed.json", e).rstrip("."))
    line = error.rstrip() + (f" ({'; '.join(unwritten)})" if unwritten else "")
    try:
        print(f"error: {line}", file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - stderr closed: nothing left to tell
        pass
    return {"point": where, "ok": False, "failed": True, "errors": [error]}


def error_line(e: BaseException) -> str:
    """The one line for a failed run: a file that could not be written (a full disk) is said as
    such, naming the file, whichever rank or layer met it; a peer's failure as its watchdog named it,
    and a connection broken with no one naming why in words (the workers torchrun or Slurm
    started: no launcher names it for them); anything else as it was reported."""
    from ..atomic import WriteError, is_disk_full, write_sentence
    from ..runtime.failure import WorkerAborted, failure_message, is_transport_error, transport_reason
    from .common import joined_rank

    text = str(e)
    at = text.find("could not write ")
    if "WriteError" in text and at >= 0:  # a worker's: "rank 0 failed while running ...: WriteError: ..."
        return text[at:].splitlines()[0].strip()
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, WriteError):
            return seen.sentence
        if isinstance(seen, OSError) and is_disk_full(seen) and seen.filename:
            return write_sentence(seen.filename, seen)
        seen = seen.__cause__ or seen.__context__
    if hasattr(e, "errors") or isinstance(e, WorkerAborted):  # the launcher's, or a peer's named by its watchdog
        return text
    if is_transport_error(e):
        return failure_message(joined_rank(), "", f"it lost its connection to another rank ({transport_reason(e)})")
    return one_line(e)


def record_interrupted(cfg: DictConfig, out: Path, run_info: dict[str, Any], e: BaseException) -> None:
    """A run stopped by SIGINT or SIGTERM: ``metrics.json`` with what rank 0 measured up to the
    stop and ``"status": "interrupted"``, or ``failed.json`` when no step had finished. Never
    raises (the stop's own line follows)."""
    import signal
    import sys

    from ..atomic import write_json, write_sentence
    from ..report import metrics_json as report
    from ..report import progress

    signum = getattr(e, "signum", signal.SIGINT)
    error = str(e) or f"stopped by {signal.Signals(signum).name}"
    path = out / "metrics.json"
    try:
        steps, val = progress.read(out)
        try:
            config: Any = OmegaConf.to_container(cfg, resolve=True)
        except Exception:  # noqa: BLE001
            config = OmegaConf.to_container(cfg, resolve=False)
        if steps:
            report.write(report.interrupted(config, run_info, steps, val, "interrupted", error), out)
            console().print(f"wrote {path} (interrupted after {len(steps)} steps)", highlight=False, soft_wrap=True)
        else:
            path = out / "failed.json"
            write_json(path, {"config": config, "status": "interrupted", "error": error, "steps": [], "val": val})
        progress.remove(out)
    except Exception as err:  # noqa: BLE001 - a full disk: one more line, and the stop goes on
        try:
            print(f"error: {write_sentence(path, err)}", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001
            pass
