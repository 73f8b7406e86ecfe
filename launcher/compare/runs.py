"""Find the runs under some directories and read what each left: ``metrics.json`` (a training run
that finished), ``failed.json`` or ``invalid.json`` (one that did not), and its W&B offline run."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..report.wandb_read import find_runs as find_wandb, read_run

OUTCOMES = ("metrics.json", "failed.json", "invalid.json")


@dataclass
class Run:
    """One run directory: its status, its metrics when it trained, its error when it did not."""

    dir: Path
    name: str
    status: str  # ok | interrupted | failed | invalid
    metrics: dict[str, Any] | None = None
    error: str | None = None
    wandb: dict[str, Any] = field(default_factory=dict)  # id, group, tags of its W&B run, if any

    @property
    def point(self) -> str:
        """The overrides the run was started with (a sweep point's), as the launcher printed them."""
        if self.metrics:
            return str(self.metrics.get("run", {}).get("point", ""))
        return ""

    @property
    def pipeline(self) -> Path | None:
        p = self.dir / "pipeline.png"
        return p if self.metrics and p.exists() else None


def _name(d: Path, roots: list[Path]) -> str:
    for r in roots:
        if d == r:
            return d.name
        if r in d.parents:
            return f"{r.name}/{d.relative_to(r)}"
    return str(d)


def read(d: Path, roots: list[Path]) -> Run:
    """The run in directory ``d``."""
    name = _name(d, roots)
    if (d / "metrics.json").exists():
        metrics = json.loads((d / "metrics.json").read_text())
        status = metrics.get("status", "ok")
        # an interrupted run's metrics hold its steps only: listed with why it stopped, not charted
        run = (Run(d, name, "ok", metrics=metrics) if status == "ok"
               else Run(d, name, status, error=metrics.get("error") or status))
    elif (d / "failed.json").exists():
        run = Run(d, name, "failed", error=json.loads((d / "failed.json").read_text()).get("error"))
    else:
        errors = json.loads((d / "invalid.json").read_text()).get("errors") or ["?"]
        run = Run(d, name, "invalid", error=" ".join(errors))
    found = find_wandb(d)
    if found:
        w = read_run(found[0])
        run.wandb = {"id": w.id, "group": w.group, "tags": w.tags}
    return run


def collect(paths: Iterable[str | Path]) -> list[Run]:
    """Every run under ``paths`` (run directories or sweeps), in directory order (a sweep's points
    by number). Raises ``FileNotFoundError`` naming a path that does not exist."""
    roots = [Path(p).resolve() for p in paths]
    dirs: set[Path] = set()
    for r in roots:
        if not r.is_dir():
            raise FileNotFoundError(f"{r} is not a directory")
        for name in OUTCOMES:
            dirs.update(p.parent for p in r.rglob(name) if "wandb" not in p.parts)

    def key(d: Path) -> tuple:
        return tuple(int(x) if x.isdigit() else x for x in d.parts)

    return [read(d, roots) for d in sorted(dirs, key=key)]
