"""What a run leaves in Weights & Biases beside Lightning's per-step scalars: the summary
(predicted beside measured), the per-worker predicted-vs-measured table, each recovery from a lost
worker (a table row), the pipeline diagram and ``trace.json`` (saved as a file of the run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping


def summary_of(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Flat ``name/predicted`` and ``name/measured`` scalars, and the first and last loss."""
    out: dict[str, Any] = {}
    for key in ("latency_s", "throughput_samples_per_s", "bubble_fraction"):
        for side in ("predicted", "measured"):
            out[f"{key}/{side}"] = metrics[key][side]
    steps = metrics.get("steps") or []
    if steps:
        out["loss/first"], out["loss/last"] = steps[0]["loss"], steps[-1]["loss"]
    if metrics.get("val"):
        out["val_loss/last"] = metrics["val"][-1]["val_loss"]
    recoveries = metrics.get("recoveries") or []
    if recoveries:  # lost workers recovered inside the job (fault.restarts)
        out["recoveries"] = len(recoveries)
        out["recovery_s"] = sum(r["seconds"] for r in recoveries)
        out["recovery_steps_lost"] = sum(r["steps_lost"] for r in recoveries)
    return out


def per_worker_rows(metrics: Mapping[str, Any]) -> list[list[Any]]:
    """``[worker, metric, predicted, measured]`` rows of the per-worker comparison."""
    rows: list[list[Any]] = []
    for key, v in metrics.get("per_worker", {}).items():
        items = v.items() if key.startswith("traffic_") else [(None, v)]
        for kind, pm in items:
            name = f"{key}/{kind}" if kind else key
            measured = pm["measured"] or []
            predicted = pm["predicted"] or [None] * len(measured)
            for w, (p, m) in enumerate(zip(predicted, measured)):
                rows.append([w, name, p, m])
    return rows


#: the columns of the ``recovery_events`` table: one row per recovery from a lost worker
RECOVERY_COLUMNS = ["generation", "step", "seconds", "steps_lost", "lost_ranks", "during", "from", "workers_before",
                    "workers_after", "scheme_before", "scheme_after", "chosen_by", "cause"]


def recovery_rows(metrics: Mapping[str, Any]) -> list[list[Any]]:
    """One row per entry of ``metrics.json``'s ``recoveries`` (:data:`RECOVERY_COLUMNS`)."""
    rows: list[list[Any]] = []
    for r in metrics.get("recoveries") or []:
        before, after = (r.get("workers") or [None, None])[:2]
        rows.append([r.get("generation"), r.get("step"), r.get("seconds"), r.get("steps_lost"),
                     ",".join(map(str, r.get("lost_ranks") or [])), r.get("during", "a training step"), r.get("from"),
                     before, after, r.get("scheme_before"), r.get("scheme_after"), r.get("chosen_by"), r.get("cause")])
    return rows


def log_summary(run: Any, metrics: Mapping[str, Any], out_dir: str | Path) -> None:
    """Log ``metrics`` into the W&B ``run``: summary, table and (if written) the diagram; each
    recovery from a lost worker as a row of the ``recovery_events`` table (the summary counts them)."""
    import wandb

    run.summary.update(summary_of(metrics))
    extra: dict[str, Any] = {"per_worker": wandb.Table(columns=["worker", "metric", "predicted", "measured"],
                                                        data=per_worker_rows(metrics))}
    if metrics.get("recoveries"):
        extra["recovery_events"] = wandb.Table(columns=list[str | int](RECOVERY_COLUMNS), data=recovery_rows(metrics))
    png = Path(out_dir) / metrics["diagram"] if metrics.get("diagram") else None
    if png is not None and png.exists():
        extra["pipeline"] = wandb.Image(str(png))
    run.log(extra)
    trace = Path(out_dir) / "trace.json"  # the measured step as a Chrome trace, under the run's files
    if trace.exists():
        run.save(str(trace), base_path=str(out_dir), policy="now")
