"""Rich tables of a simulated step: per worker with a total row, simulated vs closed form, and
one row per point of a sweep."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from rich.table import Table

from ..schedule.closed_form import METRICS, SEEDS

#: per-worker columns: (key in summary["per_worker"], header)
COLUMNS = (
    ("busy", "busy"),
    ("act_recv", "act recv"),
    ("grad_recv", "grad recv"),
    ("weight_fetch_stages", "fetch stages"),
    ("weight_fetch_jobs", "fetch jobs"),
    ("peak_activations", "peak act"),
    ("peak_activation_units", "peak units"),  # what memory_limit bounds (schedule.activations); simulate only
    ("weights_owned", "owned"),
    ("weights_peak_resident", "peak resident"),
    ("copies_sent", "copy sent"),  # fault.copies=1: stages sent after each step (launcher.schedule.copies)
    ("copies_kept", "copy kept"),  # and stages whose copy the worker keeps
)

METRIC_NOTES = {
    "latency_fb": "latency / (F + B)",
    "act_xmit": "max act + grad received",
    "weight_xmit": "max stages fetched",
    "act_storage": "max peak activations",
    "weight_storage": "max stages owned",
}


def fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if x != x or x in (float("inf"), float("-inf")):  # a nan loss: said, not a crash in int()
            return str(x)
        if abs(x) < 1e-12:  # rounding noise about zero (a bubble of 1 - 1.0000000000000002): 0, not -2.2e-16
            return "0"
        return f"{x:.0f}" if x == int(x) else f"{x:.3g}" if abs(x) < 1 else f"{x:.2f}"
    return str(x)


def per_worker_table(summary: Mapping[str, Any], title: str = "per worker") -> Table:
    pw, total = summary["per_worker"], summary["total"]
    latency = summary["latency"]
    columns = [(k, header) for k, header in COLUMNS if k in pw]
    t = Table(title=title, title_justify="left")
    t.add_column("worker", justify="right")
    for _, header in columns:
        t.add_column(header, justify="right")
    t.add_column("util", justify="right")
    for w in range(summary["workers"]):
        util = pw["busy"][w] / latency if latency else 0.0
        t.add_row(f"w{w}", *(fmt(pw[k][w]) for k, _ in columns), f"{util:.2f}")
    t.add_section()
    t.add_row("total", *(fmt(total[k]) for k, _ in columns), f"{summary['utilization']:.2f}", style="bold")
    return t


def closed_form_table(rec: Mapping[str, Any], title: str = "simulated vs closed form (units of F + B)") -> Table:
    """One row per closed-form metric: the simulated value beside each reference table's formula
    (``seed 000``, ``seed 001``: docs/design.md, "Closed forms"); a note
    where a formula exists and differs."""
    cf, sim = rec["closed_form"], rec["simulated"]
    t = Table(title=title, title_justify="left")
    t.add_column("metric")
    t.add_column("simulated", justify="right")
    for seed in SEEDS:
        t.add_column(f"seed {seed}", justify="right")
    t.add_column("note")
    for m in METRICS:
        vals = [cf.get(seed, {}).get(m) for seed in SEEDS]
        differ = [seed for seed, v in zip(SEEDS, vals) if v is not None and abs(v - sim[m]) > 1e-9]
        note = METRIC_NOTES[m]
        if differ:
            note += "; differs: " + ", ".join(differ)
        t.add_row(m, fmt(sim[m]), *(fmt(v) for v in vals), note)
    regimes = [f"{seed}: {cf[seed]['regime'] or 'no row'}" for seed in SEEDS if seed in cf]
    t.caption = ("rows used - " + "; ".join(regimes)) if regimes else "no closed form for a custom placement"
    return t


def sweep_table(points: Sequence[Mapping[str, Any]], title: str = "sweep") -> Table:
    """One row per point of a multirun: its overrides, then latency, throughput, memory and traffic
    (totals over workers, maxima where marked), or that it was skipped. A sweep that trained gets
    :func:`train_sweep_table`."""
    if any("metrics" in p or p.get("failed") for p in points):
        return train_sweep_table(points, title)
    t = Table(title=title, title_justify="left")
    cols = ("#", "point", "W", "latency", "utilization", "rho", "max peak act", "act+grad recv", "fetch stages",
            "max owned", "status")
    for col in cols:
        t.add_column(col, justify="left" if col in ("point", "status") else "right")
    for i, p in enumerate(points):
        s = p.get("summary")
        if s:
            pw, tot = s["per_worker"], s["total"]
            t.add_row(
                str(i), p["point"], str(s["workers"]), fmt(s["latency"]), f"{s['utilization']:.2f}",
                f"{s['rho']:.2f}", fmt(max(pw["peak_activations"])), fmt(tot["act_recv"] + tot["grad_recv"]),
                fmt(tot["weight_fetch_stages"]), fmt(max(pw["weights_owned"])), "ok",
            )
        else:
            t.add_row(str(i), p["point"], *[""] * (len(cols) - 3),
                      "ok (plan.json)" if p.get("ok") else "skipped: invalid")
    return t


def _mib(x: Any) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def _status(p: Mapping[str, Any]) -> str:
    if p.get("ok"):
        return "ok"
    reason = (p.get("errors") or ["?"])[0]
    return f"{'failed' if p.get('failed') else 'invalid'}: {reason[:80]}{'...' if len(reason) > 80 else ''}"


def train_sweep_table(points: Sequence[Mapping[str, Any]], title: str = "sweep") -> Table:
    """One row per point of a training sweep: step time and throughput (predicted / measured),
    bubble, the largest peak activation bytes and process memory over the workers, the last loss,
    and the status (ok, invalid: why, failed: the error)."""
    t = Table(title=title, title_justify="left")
    cols = ("#", "point", "W", "step ms (pred / meas)", "samples/s (pred / meas)", "bubble (pred / meas)",
            "peak act MiB", "peak mem MiB", "loss", "status")
    for col in cols:
        t.add_column(col, justify="left" if col in ("point", "status") else "right")
    for i, p in enumerate(points):
        m = p.get("metrics")
        if not m:
            t.add_row(str(i), p["point"], *[""] * (len(cols) - 3), _status(p))
            continue
        lat, thr, bub, pw = m["latency_s"], m["throughput_samples_per_s"], m["bubble_fraction"], m["per_worker"]
        act = pw.get("peak_activation_bytes", {}).get("measured") or [None]
        mem = pw["peak_memory_bytes"]["measured"]
        steps = m.get("steps") or [{}]
        t.add_row(str(i), p["point"], str(m["run"]["W"]),
                  f"{fmt(lat['predicted'] and lat['predicted'] * 1e3)} / {fmt(lat['measured'] * 1e3)}",
                  f"{fmt(thr['predicted'])} / {fmt(thr['measured'])}",
                  f"{fmt(bub['predicted'])} / {fmt(bub['measured'])}",
                  _mib(max(act) if None not in act else None), _mib(max(mem)), fmt(steps[-1].get("loss")), "ok")
    return t


def metrics_headline(m: Mapping[str, Any]) -> str:
    """One line: the run, its steps and how the loss went."""
    run = m["run"]
    steps = m.get("steps") or []
    line = (f"train {run['scheme']} G={run['G']} R={run['R']} W={run['W']} stages={run['stages']} "
            f"microbatches={run['microbatches']} order={run['order']}: {len(steps)} steps")
    if steps:
        line += f", loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}"
    if m.get("val"):
        line += f", val_loss {m['val'][-1]['val_loss']:.4f}"
    return line


def metrics_tables(m: Mapping[str, Any]) -> list[Table]:
    """The end-of-run summary of a training run: the step (predicted beside measured) and every
    worker's memory and traffic (predicted / measured)."""
    t = Table(title="step", title_justify="left")
    for col in ("", "predicted", "measured"):
        t.add_column(col, justify="left" if not col else "right")
    lat, thr, bub = m["latency_s"], m["throughput_samples_per_s"], m["bubble_fraction"]
    t.add_row("step time (ms)", fmt(lat["predicted"] and lat["predicted"] * 1e3), fmt(lat["measured"] * 1e3))
    t.add_row("throughput (samples/s)", fmt(thr["predicted"]), fmt(thr["measured"]))
    t.add_row("bubble fraction", fmt(bub["predicted"]), fmt(bub["measured"]))
    tables = [t]
    pw = m.get("per_worker", {})
    if "peak_activations" in pw:
        w = Table(title="per worker (predicted / measured; traffic = received)", title_justify="left")
        for col in ("worker", "bubble", "peak act", "peak act MiB", "owned", "resident", "act+grad msgs",
                    "weight msgs", "MiB received", f"peak {m.get('memory_kind') or 'memory'} MiB"):
            w.add_column(col, justify="right")
        n = len(pw["peak_activations"]["measured"])
        tc, tb = pw["traffic_count"], pw["traffic_bytes"]

        def both(key: str, i: int, f: Any = fmt) -> str:
            return f"{f(pw[key]['predicted'][i])} / {f(pw[key]['measured'][i])}"

        def kinds(d: Mapping[str, Any], ks: Sequence[str], side: str, i: int) -> Any:
            vals = [d[k][side][i] for k in ks if k in d]
            return None if any(v is None for v in vals) else sum(vals)

        for i in range(n):
            w.add_row(str(i), both("bubble_fraction", i), both("peak_activations", i),
                      both("peak_activation_bytes", i, _mib), both("weights_owned", i),
                      both("weights_peak_resident", i),
                      f"{fmt(kinds(tc, ('act', 'grad'), 'predicted', i))} / "
                      f"{fmt(kinds(tc, ('act', 'grad'), 'measured', i))}",
                      f"{fmt(kinds(tc, ('weights',), 'predicted', i))} / {fmt(kinds(tc, ('weights',), 'measured', i))}",
                      f"{_mib(kinds(tb, tuple(tb), 'predicted', i))} / {_mib(kinds(tb, tuple(tb), 'measured', i))}",
                      _mib(pw["peak_memory_bytes"]["measured"][i]))
        tables.append(w)
    return tables
