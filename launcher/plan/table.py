"""The planner's ranked candidates as a rich table and as ``plan.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from .search import Candidate, Ranking


def _si(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    for div, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def candidates_table(plan: Ranking, seconds: bool, rows: int = 10, title: str = "plan") -> Table:
    """Top ``rows`` candidates: predicted step time, throughput, bubble, peak memory, traffic."""
    t = Table(title=title, title_justify="left")
    unit = "s" if seconds else "units"
    for h in ("#", "scheme", "G", "R", "B", "order", "split", "mem limit", "cache", f"step ({unit})",
              f"mb/{'s' if seconds else 'unit'}", "bubble", "peak act", "peak bytes", "traffic"):
        t.add_column(h, justify="left" if h in ("scheme", "order", "cache", "mem limit") else "right")
    for i, c in enumerate(plan.candidates[:rows]):
        p = c.point
        ml = p.memory_limit
        ml_text = "-" if ml is None else str(ml) if isinstance(ml, int) else f"{min(ml)}..{max(ml)}"
        order = p.order + (" (no warm-up)" if p.order == "1f1b" and p.warmup == "none" else "")
        traffic = _si(c.traffic_bytes, "B") if c.traffic_bytes is not None else f"{c.traffic_messages} msgs"
        t.add_row(str(i + 1), p.scheme.label, str(p.G), str(p.R), str(p.microbatches), order,
                  "yes" if p.split else "no", ml_text, p.weight_cache, f"{c.step_time:.4g}",
                  f"{c.throughput:.4g}", f"{c.bubble:.3f}", str(max(c.peak_activations)),
                  _si(max(c.peak_bytes), "B") if c.peak_bytes else "-", traffic)
    return t


def plan_record(plan: Ranking, config: dict[str, Any], seconds: bool, best: Candidate | None = None) -> dict[str, Any]:
    """``plan.json``: ``best`` (the predicted best unless ``best`` is given: the fastest measured
    by trials), ``candidates`` (ranked by prediction, each with its ``overrides``) and how the
    search went."""
    best = best if best is not None else plan.best
    return {
        "config": config,
        "units": "seconds" if seconds else "duration units",
        "best": best.to_json() if best else None,
        "candidates": [c.to_json() for c in plan.candidates],
        "search": {"simulated": plan.simulated, "pruned_by_time_bound": plan.pruned_time,
                   "pruned_by_memory_bound": plan.pruned_memory, "did_not_fit": plan.did_not_fit,
                   "same_schedule_as_listed": plan.equivalent, "auto_searched": plan.auto_searched},
    }


def write_plan(record: dict[str, Any], out_dir: Path) -> Path:
    from ..atomic import write_json

    return write_json(Path(out_dir) / "plan.json", record)


def describe(c: Candidate) -> str:
    """One line naming a candidate and its prediction."""
    p = c.point
    return (f"{p.scheme.label} G={p.G} R={p.R} microbatches={p.microbatches} order={p.order} warmup={p.warmup} "
            f"split_backward={str(p.split).lower()} memory_limit={p.memory_limit} weight_cache={p.weight_cache}"
            + (f" partition={p.partition}" if p.partition else "")
            + f": step {c.step_time:.4g}, bubble {c.bubble:.3f}")
