"""What every mode of ``python -m launcher`` shares: the console, the point being run, its run
directory, and how an invalid point is reported (one sentence per rule, ``invalid.json``)."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf


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
    """``invalid.json`` in the run directory: why this run (sweep point) did not run."""
    import json

    try:
        out = output_dir()
    except ValueError:
        return
    try:
        config: Any = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # an interpolation that cannot resolve: keep it as written
        config = OmegaConf.to_container(cfg, resolve=False)
    (out / "invalid.json").write_text(json.dumps({"config": config, "errors": sentences}, indent=2, default=str) + "\n")


def in_sweep() -> bool:
    """Whether this run is one point of a Hydra multirun."""
    try:
        return HydraConfig.get().mode.name == "MULTIRUN"
    except ValueError:
        return False


#: every file a run leaves as its outcome; a new run in the same directory removes the old ones
OUTCOMES = ("simulation.json", "invalid.json", "pipeline.png")


def clear_outcomes() -> None:
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
        print(f"{label} ...", file=sys.stderr, flush=True)
        yield
    print(f"{label}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def outcome_of(directory: Path) -> dict[str, Any] | None:
    """The result record of a point read back from its run directory (what the mode returned in
    the process that ran it, for sweeps a remote launcher such as Slurm ran elsewhere); ``None``
    when the point left nothing (it died before writing)."""
    import json

    overrides = directory / ".hydra" / "overrides.yaml"
    where = " ".join(OmegaConf.load(overrides)) if overrides.exists() else directory.name
    if (directory / "metrics.json").exists():
        return {"point": where, "ok": True, "metrics": json.loads((directory / "metrics.json").read_text())}
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
