"""Find the runs under some directories and read what each left: ``metrics.json`` (a training run
that finished), ``failed.json`` or ``invalid.json`` (one that did not), its W&B offline run and,
when it wrote one, ``trace.json`` (its measured and predicted step in Chrome's trace format).

:func:`label` names each run by what differs between the runs on the page (``gpipe``,
``lpp G=2 R=4``, ``lr=0.003``), not by its directory."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable

from ..report.wandb_read import find_runs as find_wandb
from ..report.wandb_read import read_run

OUTCOMES = ("metrics.json", "failed.json", "invalid.json")


@dataclass
class Run:
    """One run directory: its status, its metrics when it trained, its error when it did not."""

    dir: Path
    name: str  # the directory, relative to the path it was found under
    status: str  # ok | interrupted | failed | invalid
    metrics: dict[str, Any] | None = None
    error: str | None = None
    wandb: dict[str, Any] = field(default_factory=dict)  # id, group, tags of its W&B run, if any
    config: dict[str, Any] = field(default_factory=dict)  # the resolved config it ran (or was refused) with
    label: str = ""  # what sets it apart from the other runs on the page (:func:`label`)

    @property
    def point(self) -> str:
        """The overrides the run was started with (a sweep point's), as the launcher printed them."""
        if self.metrics:
            return str(self.metrics.get("run", {}).get("point", ""))
        return ""

    @property
    def scheme(self) -> str:
        s = self.config.get("strategy")
        name = s.get("name") if isinstance(s, dict) else s
        return str(name or (self.metrics or {}).get("run", {}).get("scheme") or "?")

    @property
    def pipeline(self) -> Path | None:
        p = self.dir / "pipeline.png"
        return p if self.metrics and p.exists() else None

    @cached_property
    def trace(self) -> dict[str, Any] | None:
        """The run's ``trace.json`` (``traceEvents``, ``otherData``), or None without a readable one."""
        p = self.dir / "trace.json"
        if not (self.metrics and p.exists()):
            return None
        try:
            t = json.loads(p.read_text())
        except (OSError, ValueError):
            return None
        return t if isinstance(t, dict) and isinstance(t.get("traceEvents"), list) else None


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
        run.config = metrics.get("config") or {k: v for k, v in metrics.get("run", {}).items() if k != "point"}
    elif (d / "failed.json").exists():
        failed = json.loads((d / "failed.json").read_text())
        run = Run(d, name, "failed", error=failed.get("error"), config=failed.get("config") or {})
    else:
        invalid = json.loads((d / "invalid.json").read_text())
        run = Run(d, name, "invalid", error=" ".join(invalid.get("errors") or ["?"]),
                  config=invalid.get("config") or {})
    found = find_wandb(d)
    if found:
        w = read_run(found[0])
        run.wandb = {"id": w.id, "group": w.group, "tags": w.tags}
    return run


def collect(paths: Iterable[str | Path]) -> list[Run]:
    """Every run under ``paths`` (run directories or sweeps), in directory order (a sweep's points
    by number), each labelled (:func:`label`). Raises ``FileNotFoundError`` naming a path that does
    not exist."""
    roots = [Path(p).resolve() for p in paths]
    dirs: set[Path] = set()
    for r in roots:
        if not r.is_dir():
            raise FileNotFoundError(f"{r} is not a directory")
        for name in OUTCOMES:
            dirs.update(p.parent for p in r.rglob(name) if "wandb" not in p.parts)

    def key(d: Path) -> tuple:
        # numbers first, by value (a sweep's 2 before 10), then names
        return tuple((0, int(x), "") if x.isdigit() else (1, 0, x) for x in d.parts)

    runs = [read(d, roots) for d in sorted(dirs, key=key)]
    label(runs)
    return runs


# ---- labels by difference ---------------------------------------------------------------------

#: config keys the scheme already says (the label starts with it)
_SCHEME_KEYS = ("strategy.name", "scheme")
_MISSING = object()


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model": {"lr": 1}}`` -> ``{"model.lr": 1}`` (lists stay values)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _value(v: Any) -> str:
    if v is _MISSING:
        return "-"
    if v is None:
        return "none"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:g}" if math.isfinite(v) else str(v)
    s = json.dumps(v) if isinstance(v, (list, dict)) else str(v)
    return s if len(s) <= 24 else s[:23] + "…"


def _overridden(runs: list[Run]) -> set[str]:
    """The keys someone set on a run's command line (its sweep point)."""
    keys: set[str] = set()
    for r in runs:
        for tok in r.point.split():
            k = tok.split("=", 1)[0].lstrip("+~")
            keys.add("strategy.name" if k == "strategy" else k)
            keys.add(f"{k}.name")  # order=1f1b sets order.name
    return keys


def differing(runs: list[Run]) -> list[str]:
    """The config keys whose values differ between ``runs``, in config order, the scheme left out.
    Of keys that vary together (``data.seq_len`` and ``model.seq_len``; ``G`` and ``microbatches``
    in a DDP sweep) one is kept: one set on a command line, else the shorter."""
    flat = [flatten(r.config) for r in runs]
    order: dict[str, int] = {}
    for f in flat:
        for k in f:
            order.setdefault(k, len(order))
    columns = {k: tuple(json.dumps(f.get(k, "\0missing"), sort_keys=True, default=str) for f in flat)
               for k in order if k not in _SCHEME_KEYS}
    varying = [k for k, col in columns.items() if len(set(col)) > 1]
    overridden = _overridden(runs)
    scheme_col = tuple(r.scheme for r in runs)
    kept: dict[tuple, str] = {}
    for k in sorted(varying, key=lambda k: (k not in overridden, k.count("."), order[k])):
        col = columns[k]
        if col in kept:
            continue
        # what a strategy file sets beside the scheme's name (strategy.placement...) says no more than it
        if k.startswith("strategy.") and k not in overridden and len(set(zip(scheme_col, col))) == len(set(scheme_col)):
            continue
        kept[col] = k
    keys = set(kept.values())
    if keys & {"G", "R"}:
        keys.discard("W")  # W = G * R
    return sorted(keys, key=order.__getitem__)


def _short(keys: list[str]) -> dict[str, str]:
    """Each key's name in a label: its last part, or more of it where two would read the same."""
    def tail(k: str, n: int) -> str:
        parts = k.split(".")
        if parts[-1] == "_target_":  # model._target_=launcher.models.GPT -> model=GPT
            parts = parts[:-1]
        return ".".join(parts[-n:])

    out = {}
    for k in keys:
        n = 1
        while n < k.count(".") + 1 and sum(tail(o, n) == tail(k, n) for o in keys) > 1:
            n += 1
        out[k] = tail(k, n)
    return out


def label(runs: list[Run]) -> list[str]:
    """Set (and return) each run's label: its scheme and, in short form, the config keys whose
    values differ between ``runs`` (``lpp G=2 R=4``, ``gpipe lr=0.003``); runs identical in every
    key get ``#1``, ``#2``... in directory order."""
    keys = differing(runs)
    short = _short(keys)
    flat = [flatten(r.config) for r in runs]
    for r, f in zip(runs, flat):
        parts = [r.scheme]
        for k in keys:
            v = f.get(k, _MISSING)
            if k.endswith("._target_") and isinstance(v, str):
                v = v.rsplit(".", 1)[-1]
            parts.append(f"{short[k]}={_value(v)}")
        r.label = " ".join(parts)
    same: dict[str, list[Run]] = {}
    for r in runs:
        same.setdefault(r.label, []).append(r)
    for group in same.values():
        if len(group) > 1:
            for i, r in enumerate(group):
                r.label = f"{r.label} #{i + 1}"
    return [r.label for r in runs]
