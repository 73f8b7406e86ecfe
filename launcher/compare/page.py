"""The comparison page: one self-contained HTML file (its charts embedded as PNG data, also
written beside it), rendered with Jinja2. The runs table sorts by any column on a click on its
header, or on load from the address's ``#sort=<column>`` (``-`` before it: descending)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from jinja2 import Environment

from . import charts
from .runs import Run, collect

COLUMNS = ("run", "status", "scheme", "G", "R", "W", "stages", "microbatches", "order", "step ms pred",
           "step ms meas", "samples/s meas", "bubble pred", "bubble meas", "peak act MiB", "peak mem MiB",
           "final loss", "W&B")

TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{{ title }}</title>
<style>
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: right; }
th { background: #f0f0f0; cursor: pointer; user-select: none; }
td.text { text-align: left; }
tr.failed td, tr.invalid td { color: #a00; }
img { max-width: 100%; border: 1px solid #ddd; margin: 6px 0; }
.pipelines { display: flex; flex-wrap: wrap; gap: 16px; }
.pipelines figure { margin: 0; max-width: 48%; }
</style></head><body>
<h1>{{ title }}</h1>
<p>{{ runs|length }} runs from {{ sources }}. Predicted: the simulator fed with each run's measured job
durations; measured: on the run's workers (step time: median after the first step).</p>
<h2>Runs</h2>
<table id="runs"><thead><tr>{% for c in columns %}<th data-col="{{ loop.index0 }}">{{ c }}</th>{% endfor %}</tr></thead>
<tbody>{% for row, status in rows %}<tr class="{{ status }}">{% for v in row %}<td{% if v.text %} class="text"{% endif %}
 data-v="{{ v.key }}">{{ v.shown }}</td>{% endfor %}</tr>{% endfor %}</tbody></table>
{% for title, uri in figures %}<h2>{{ title }}</h2><img alt="{{ title }}" src="{{ uri }}">{% endfor %}
{% if pipelines %}<h2>Pipeline diagrams (predicted)</h2><div class="pipelines">{% for name, uri in pipelines %}
<figure><figcaption>{{ name }}</figcaption><img alt="pipeline {{ name }}" src="{{ uri }}"></figure>{% endfor %}</div>{% endif %}
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
    """A table cell: what it shows and the key it sorts by."""

    def __init__(self, value: Any, text: bool = False, digits: int = 3) -> None:
        self.text = text
        if value is None:
            self.shown, self.key = "-", ""
        elif isinstance(value, float):
            self.shown, self.key = f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}", repr(value)
        else:
            self.shown = self.key = str(value)


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
    return [Cell(r.name, True), Cell(status, True), Cell(run.get("scheme"), True), Cell(run.get("G")),
            Cell(run.get("R")), Cell(run.get("W")), Cell(run.get("stages")), Cell(run.get("microbatches")),
            Cell(run.get("order"), True), Cell(ms(lat.get("predicted"))), Cell(ms(lat.get("measured"))),
            Cell(thr.get("measured")), Cell(bub.get("predicted")), Cell(bub.get("measured")), Cell(act), Cell(mem),
            Cell(steps[-1].get("loss"), digits=4), Cell(r.wandb.get("id"), True)]


def _uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def build(paths: list[str | Path], out: str | Path, title: str = "launcher: runs side by side") -> Path:
    """Write the page for every run under ``paths`` to ``out`` (its PNGs beside it); return its path.
    Raises ``FileNotFoundError`` for a missing directory and ``ValueError`` when there is no run."""
    runs = collect(paths)
    if not runs:
        raise ValueError(f"no runs (metrics.json, failed.json or invalid.json) under {', '.join(map(str, paths))}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    trained = [r for r in runs if r.metrics]
    figures: list[tuple[str, str]] = []
    if trained:
        stem = out.with_suffix("")
        for title_, draw, suffix in (("Predicted beside measured", charts.comparison, "comparison"),
                                     ("Loss", charts.losses, "loss"),
                                     ("Traffic per message kind (received)", charts.traffic, "traffic")):
            figures.append((title_, _uri(draw(trained, Path(f"{stem}.{suffix}.png")))))
    html = Environment(autoescape=True).from_string(TEMPLATE).render(
        title=title, runs=runs, sources=", ".join(map(str, paths)), columns=COLUMNS,
        rows=[(_row(r), r.status) for r in runs], figures=figures,
        pipelines=[(r.name, _uri(r.pipeline)) for r in trained if r.pipeline is not None])
    from ..atomic import write_text

    write_text(out, html)
    return out
