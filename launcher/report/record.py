"""``simulation.json``: the resolved config, the simulated metrics and the reference closed forms
(docs/design.md, "Closed forms").

Keys (read by other tools; see README): ``config``, ``latency`` (duration units), ``latency_fb``
(units of F + B), ``utilization`` (busy time / (W * latency)), ``bubble_fraction``
(1 - utilization), ``rho`` (S*B / (latency_fb * W)), ``workers``, ``jobs``, ``per_worker``
(lists indexed by worker), ``totals``, ``closed_form`` (per reference table, ``000`` and
``001``: metric -> value or null, and the ``regime`` row used) and ``simulated`` (the simulated
counterpart of each closed-form metric).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ..schedule.closed_form import closed_forms, simulated_counterparts
from ..schedule.schemes import SCHEMES


def comparison(summary: Mapping[str, Any], scheme: str, S: int, B: int, G: int, R: int) -> dict[str, Any]:
    """``{"closed_form": {seed: {metric: value}}, "simulated": {metric: value}}``; the closed
    forms are empty for a custom placement (the reference tables give none)."""
    cf = closed_forms(scheme, S, B, G, R) if scheme in SCHEMES else {}
    return {"closed_form": cf, "simulated": simulated_counterparts(dict(summary))}


#: what a step costs back to back and under which rule (:func:`launcher.schedule.overlap.priced`)
STEP_COST_KEYS = ("step_overlap", "step_cost", "step_bubble_fraction", "steady_steps")


def record(config: Mapping[str, Any], summary: Mapping[str, Any], scheme: str) -> dict[str, Any]:
    """The JSON-ready record of one simulated step."""
    c = config
    cmp = comparison(summary, scheme, c["stages"], c["microbatches"], c["G"], c["R"])
    return {
        "config": dict(config),
        "latency": summary["latency"],
        "latency_fb": summary["latency_fb"],
        "utilization": summary["utilization"],
        "bubble_fraction": summary["bubble_fraction"],
        "rho": summary["rho"],
        **{k: summary[k] for k in STEP_COST_KEYS if k in summary},
        "workers": summary["workers"],
        "jobs": summary["jobs"],
        "per_worker": summary["per_worker"],
        "totals": summary["total"],
        "closed_form": cmp["closed_form"],
        "simulated": cmp["simulated"],
    }


def write_record(rec: Mapping[str, Any], directory: str | Path, name: str = "simulation.json") -> Path:
    from ..atomic import write_json

    return write_json(Path(directory) / name, rec)
