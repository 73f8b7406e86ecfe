"""The comparison page: one self-contained HTML file, rendered with Jinja2, that answers "which
scheme should I use?". Runs are named by what differs between them (:func:`.runs.label`); the best
run on each metric is starred in the table and on every chart; the charts are interactive (plotly,
its plotly.js embedded once, so the page works offline from ``file://``): predicted beside measured
per metric, the loss curves (those that coincide said so), traffic per message kind, and each run's
measured step beside its predicted one from ``trace.json`` (else its predicted ``pipeline.png``).
The runs table sorts by any column on a click on its header, or on load from the address's
``#sort=<column>`` (``-`` before it: descending)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from jinja2 import Environment
from markupsafe import Markup

from . import charts
from .runs import Run, collect

COLUMNS = ("run", "dir", "status", "scheme", "G", "R", "W", "stages", "microbatches", "order", "step ms pred",
           "step ms meas", "samples/s meas", "bubble pred", "bubble meas", "peak act MiB", "peak mem MiB",
           "final loss", "W&B")
#: the metric columns: which way is better
BETTER = {"step ms pred": "lower", "step ms meas": "lower", "samples/s meas": "higher", "bubble pred": "lower",
          "bubble meas": "lower", "peak act MiB": "lower", "peak mem MiB": "lower", "final loss": "lower"}
#: the summary's lines: column -> what it says
SUMMARY = {"step ms meas": "fastest step (measured)", "samples/s meas": "highest throughput (measured)",
           "step ms pred": "fastest step (predicted)", "bubble meas": "smallest bubble (measured)",
           "peak mem MiB": "least memory (max worker, measured)", "peak act MiB": "least activation memory (measured)",
           "final loss": "lowest final train loss"}

UNITS = {"step ms pred": " ms", "step ms meas": " ms", "samples/s meas": " samples/s", "peak act MiB": " MiB",
         "peak mem MiB": " MiB"}

TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{{ title }}</title>
<style>
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: right; }
th { background: #f0f0f0; cursor: pointer; user-select: none; }
td.text { text-align: left; }
td.label { text-align: left; white-space: nowrap; }
td.best { font-weight: bold; background: #fff7d6; }
tr.failed td, tr.invalid td, tr.interrupted td { color: #a00; }
img { max-width: 100%; border: 1px solid #ddd; margin: 6px 0; }
.chart { border: 1px solid #eee; margin: 6px 0 18px; }
.note, figcaption { font-size: 13px; color: #444; max-width: 1200px; }
.pipelines { display: flex; flex-wrap: wrap; gap: 16px; }
.pipelines figure { margin: 0; max-width: 48%; }
.timeline { margin: 0 0 28px; }
ul.best li { margin: 2px 0; }
</style>
{% if plotlyjs %}<script>{{ plotlyjs }}</script>{% endif %}
</head><body>
<h1>{{ title }}</h1>
<p>{{ runs|length }} run{{ "s" if runs|length != 1 }} from {{ sources }}, named by what differs between
them{% if keys %} (scheme, {{ keys|join(", ") }}){% else %} (their scheme){% endif %}. Predicted: the simulator fed with
each run's measured job durations; measured: on the run's workers (step time: median after the first
step). ★ marks the best run on each metric (↓ lower is better, ↑ higher is better).</p>
{% if summary %}<h2>Best by metric</h2><ul class="best">{% for what, who, value in summary %}
<li>{{ what }}: <b>{{ who }}</b> ({{ value }})</li>{% endfor %}</ul>{% endif %}
<h2>Runs</h2>
<table id="runs"><thead><tr>{% for c, arrow, tip in columns %}<th data-col="{{ loop.index0 }}"{% if tip %}
 title="{{ tip }}"{% endif %}>{{ c }}{% if arrow %} {{ arrow }}{% endif %}</th>{% endfor %}</tr></thead>
<tbody>{% for row, status in rows %}<tr class="{{ status }}">{% for v in row %}<td
{%- if v.cls %} class="{{ v.cls }}"{% endif %}{% if v.best %} title="best: {{ v.best }} is better"{% endif %}
 data-v="{{ v.key }}">{% if v.best %}★ {% endif %}{{ v.shown }}</td>{% endfor %}</tr>{% endfor %}</tbody></table>
{% for title, div, note in figures %}<h2>{{ title }}</h2>{% if note %}<p class="note">{{ note }}</p>{% endif %}
<div class="chart">{{ div }}</div>{% endfor %}
{% if timelines %}<h2>Timelines: measured above predicted</h2>
{% for name, div, caption in timelines %}<figure class="timeline"><div class="chart">{{ div }}</div>
<figcaption>{{ caption }}</figcaption></figure>{% endfor %}{% endif %}
{% if pipelines %}<h2>Pipeline diagrams (predicted)</h2><div class="pipelines">{% for name, uri, caption in pipelines %}
<figure><img alt="pipeline {{ name }}" src="{{ uri }}"><figcaption><b>{{ name }}</b>: {{ caption }}</figcaption>
</figure>{% endfor %}</div>{% endif %}
<script>
function sortBy(col, desc) {
  const body = document.querySelector("#runs tbody");
  const rows = Array.from(body.rows);
  const key = r => { const v = r.cells[col].dataset.v; const n = parseFloat(v); return isNaN(n) ? v : n; };
  rows.sort((a, b) => { const x = key(a), y = key(b); const c = x < y ? -1 : x > y ? 1 : 0; return desc ? -c : c; });
  rows.forEach(r => body.appendChild(r));
  document.querySelector("#runs").dataset.sorted = (desc ? "-" : "") + col;
}
document.querySelectorAll("#runs th").forEach(th => th.addEventListener("click", () => {
  const col = +th.dataset.col, t = document.querySelector("#runs");
  sortBy(col, t.dataset.sorted === String(col));
}));
const m = location.hash.match(/sort=(-?)(\\d+)/);
if (m) sortBy(+m[2], m[1] === "-");
</script>
</body></html>
"""


class Cell:
    """A table cell: what it shows and the key it sorts by; ``best``: the direction, when it is the best."""

    def __init__(self, value: Any, text: bool = False, digits: int = 3) -> None:
        self.cls = "text" if text else ""
        self.value = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        self.best = ""
        if value is None:
            self.shown, self.key = "-", ""
        elif isinstance(value, float):
            self.shown, self.key = f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}", repr(value)
        else:
            self.shown = self.key = str(value)

    def mark(self, better: str) -> None:
        self.best = better
        self.cls = "best"


def _row(r: Run) -> list[Cell]:
    m = r.metrics or {}
    run = m.get("run", {})
    pw = m.get("per_worker", {})
    lat, thr, bub = m.get("latency_s", {}), m.get("throughput_samples_per_s", {}), m.get("bubble_fraction", {})
    act = charts._max(pw.get("peak_activation_bytes", {}).get("measured"), 2**20)
    mem = charts._max(pw.get("peak_memory_bytes", {}).get("measured"), 2**20)
    steps = m.get("steps") or [{}]
    ms = lambda x: x * 1e3 if x is not None else None  # noqa: E731
    status = r.status if r.status == "ok" else f"{r.status}: {r.error}"
    cfg = r.config
    get = lambda k: run.get(k, cfg.get(k))  # noqa: E731
    order = run.get("order") or cfg.get("order")
    order = order.get("name") if isinstance(order, dict) else order
    label = Cell(r.label, True)
    label.cls = "label"
    where = Cell(r.name, True)
    where.cls = "label"
    return [label, where, Cell(status, True), Cell(r.scheme, True), Cell(get("G")),
            Cell(get("R")), Cell(get("W")), Cell(get("stages")), Cell(get("microbatches")),
            Cell(order, True), Cell(ms(lat.get("predicted"))), Cell(ms(lat.get("measured"))),
            Cell(thr.get("measured")), Cell(bub.get("predicted")), Cell(bub.get("measured")), Cell(act), Cell(mem),
            Cell(steps[-1].get("loss"), digits=4), Cell(r.wandb.get("id"), True)]


def _mark_best(rows: list[list[Cell]], runs: list[Run]) -> list[tuple[str, str, str]]:
    """Star the best cell of each metric column among the runs that trained; the summary's lines."""
    ok = [i for i, r in enumerate(runs) if r.status == "ok"]
    wins = {}
    for c, better in BETTER.items():
        col = COLUMNS.index(c)
        wins[c] = sorted(charts.best([rows[i][col].value for i in ok], better))
        for k in wins[c]:
            rows[ok[k]][col].mark(better)
    return [(what, ", ".join(runs[ok[k]].label for k in wins[c]) + (" (tie)" if len(wins[c]) > 1 else ""),
             rows[ok[wins[c][0]]][COLUMNS.index(c)].shown + UNITS.get(c, ""))
            for c, what in SUMMARY.items() if wins[c]]


def _uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def _div(fig: Any, div_id: str) -> Markup:
    """The figure as a ``<div>`` and its script (plotly.js itself is in the page's head, once)."""
    return Markup(fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, config=charts.PLOT_CONFIG))


def _fmt(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, (int, float)) else "?"


def _timeline_caption(r: Run, tr: charts.Trace) -> str:
    o = tr.other
    lat = (r.metrics or {}).get("latency_s", {})
    table_pred = lat.get("predicted") and lat["predicted"] * 1e3
    table_meas = lat.get("measured") and lat["measured"] * 1e3
    pred, meas = o.get("predicted_step_ms"), o.get("measured_step_ms")
    parts = [f"{r.name}: step {o.get('step', '?')} of {r.label}"
             + (f" ({o['clock']} clock)" if o.get("clock") else "")
             + f", {tr.workers} workers, {tr.stages} stages, {o.get('microbatches', '?')} micro-batches."
             f" Measured step {_fmt(meas)} ms, predicted {_fmt(pred)} ms (the table: {_fmt(table_meas)} ms measured,"
             f" the median over the steps after the first, and {_fmt(table_pred)} ms predicted)."]
    if isinstance(pred, (int, float)) and isinstance(table_pred, (int, float)) and \
            abs(pred - table_pred) > 0.01 * max(abs(table_pred), 1e-9):
        parts.append(f"The trace's predicted step ({_fmt(pred)} ms) differs from the table's ({_fmt(table_pred)} ms).")
    last = tr.last_job("predicted")
    if isinstance(pred, (int, float)) and tr.jobs["predicted"] and pred > last * 1.001:
        parts.append(f"The last predicted job ends at {_fmt(last)} ms; the rest of the predicted step is the"
                     " end-of-step gradient exchange, optimizer step and framework time"
                     + (" (the grey bars)." if tr.other_events["sync"]["predicted"] else "."))
    parts.append("Both panels share one time axis (ms from the step's start; dashed: each side's step time). Colour:"
                 " job kind; shade: stage (dark = first). Drag to zoom both, double-click to reset; hover a bar for"
                 " its job, stage, micro-batch, start and duration.")
    return " ".join(parts)


def _two_steps_note(r: Run) -> str:
    cost = (r.metrics or {}).get("step_cost_s") or {}
    over, barrier = cost.get("predicted_post_validation"), cost.get("predicted")
    return ("The run ended every step on every worker before the next began; this is the same programs, at the"
            " times its workers measured, if each stage took its optimizer step as soon as its own gradients"
            " were final (the zero-bubble paper's post-validation): the next step's forwards fill the last"
            f" one's drain. Step cost {_fmt(over and over * 1e3)} ms so, against {_fmt(barrier and barrier * 1e3)} ms"
            " behind the barrier (predicted); dashed lines: each step's end.")


def _pipeline_caption(r: Run) -> str:
    m = r.metrics or {}
    pred = (m.get("latency_s") or {}).get("predicted")
    outside = (m.get("profile") or {}).get("outside_s")
    return ("predicted from the profiled step (no trace.json: no measured timeline). Its time axis is in seconds and"
            " ends where the last predicted job does; the predicted step time in the table"
            f" ({_fmt(pred and pred * 1e3)} ms) also counts what each worker does after its last job, which the"
            " diagram does not draw: the end-of-step gradient exchange, the optimizer step and the framework's"
            f" time outside the engine ({_fmt(outside and outside * 1e3)} ms a step)."
            if pred else "predicted from the profiled step.")


def build(paths: list[str | Path], out: str | Path, title: str = "launcher: runs side by side") -> Path:
    """Write the page for every run under ``paths`` to ``out``; return its path. Raises
    ``FileNotFoundError`` for a missing directory and ``ValueError`` when there is no run."""
    from .runs import differing

    runs = collect(paths)
    if not runs:
        raise ValueError(f"no runs (metrics.json, failed.json or invalid.json) under {', '.join(map(str, paths))}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    trained = [r for r in runs if r.metrics]
    figures: list[tuple[str, Markup, str]] = []
    timelines: list[tuple[str, Markup, str]] = []
    pipelines: list[tuple[str, str, str]] = []
    if trained:
        reducing = [r.label for r in trained if charts.all_reduces(r)]
        traffic_note = charts.ALL_REDUCE_NOTE.format(runs=", ".join(reducing)) if reducing else ""
        figures.append(("Predicted beside measured", _div(charts.comparison(trained), "comparison"), traffic_note))
        fig, groups = charts.losses(trained)
        note = " ".join(f"{', '.join(g)} coincide (train and validation loss equal within"
                        f" {charts.COINCIDE_RTOL:g}, relative, at every step): drawn one over another, each thinner,"
                        " with its own dash and markers." for g in groups)
        figures.append(("Loss", _div(fig, "loss"), note))
        fig = charts.traffic(trained)
        if fig is not None:
            figures.append(("Traffic per message kind (received)", _div(fig, "traffic"), traffic_note))
        for i, r in enumerate(trained):  # issue 49: what the same programs would cost back to back
            fig = charts.two_steps(r)
            if fig is not None:
                figures.append((f"Two steps back to back, predicted with step_overlap=post_validation: {r.label}",
                                _div(fig, f"two-steps-{i}"), _two_steps_note(r)))
        for i, r in enumerate(trained):
            why = ""
            try:
                tr = charts.read_trace(r.trace) if r.trace is not None else None
            except (TypeError, ValueError, KeyError, AttributeError) as e:
                tr, why = None, f"trace.json could not be read ({type(e).__name__}: {e}); "
            if tr is not None and 0 < tr.njobs <= charts.MAX_TRACE_JOBS:
                timelines.append((r.label, _div(charts.timeline(r, tr), f"timeline-{i}"), _timeline_caption(r, tr)))
                continue
            if tr is not None:
                why = f"trace.json has {tr.njobs} jobs, {'too many to draw here' if tr.njobs else 'none to draw'}; "
            if r.pipeline is not None:
                pipelines.append((r.label, _uri(r.pipeline), why + _pipeline_caption(r)))
    rows = [_row(r) for r in runs]
    summary = _mark_best(rows, runs)
    columns = [(c, {"lower": "↓", "higher": "↑"}.get(BETTER.get(c, ""), ""),
                f"{BETTER[c]} is better" if c in BETTER else "") for c in COLUMNS]
    plotlyjs = ""
    if figures:
        from plotly.offline import get_plotlyjs

        plotlyjs = Markup(get_plotlyjs())
    page = Environment(autoescape=True).from_string(TEMPLATE).render(
        title=title, runs=runs, sources=", ".join(map(str, paths)), columns=columns, keys=differing(runs),
        rows=[(row, r.status) for row, r in zip(rows, runs)], figures=figures, timelines=timelines,
        pipelines=pipelines, summary=summary, plotlyjs=plotlyjs)
    from ..atomic import write_text

    write_text(out, page)
    return out
