"""The dashboard's figures, interactive (plotly; the page embeds plotly.js once): each metric
predicted beside measured per run, the loss curves, traffic per message kind and, for a run that
wrote ``trace.json``, its measured step beside the predicted one as a timeline. Runs are named by
their labels (:func:`launcher.compare.runs.label`); the best run on each metric is starred."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .runs import Run

KINDS = ("act", "grad", "weights", "wgrad", "reduce", "bcast")  # the last two: runs from before replicas all-reduced
SIDES = (("predicted", "#9ecae1"), ("measured", "#2171b5"))
#: a run's colour in every chart (plotly's qualitative palette)
PALETTE = ("#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#19d3f3", "#ff6692", "#b6e880", "#ff97ff",
           "#fecb52")
#: curves whose losses differ by no more than this (relative) at every step coincide
COINCIDE_RTOL = 1e-6
#: a timeline with more jobs than this is not drawn (the page would weigh tens of MB): pipeline.png instead
MAX_TRACE_JOBS = 20_000
#: no logo, and no "Share chart..." button (it uploads the chart to Plotly's cloud): the page stays offline
PLOT_CONFIG = {"displaylogo": False, "responsive": True, "showSendToCloud": False,
               "modeBarButtonsToRemove": ["lasso2d", "select2d", "sendChartToCloud"]}


def _max(xs: Sequence[Any] | None, scale: float = 1.0) -> float | None:
    xs = [x for x in (xs or []) if x is not None]
    return max(xs) / scale if xs else None


def _sum_kinds(m: dict, side: str) -> float | None:
    tb = m["per_worker"]["traffic_bytes"]
    vals = [v for k in tb for v in (tb[k][side] or []) if v is not None]
    return float(sum(vals)) / 2**20 if vals else None


def _final_loss(m: dict, side: str) -> float | None:
    steps = m.get("steps") or []
    return steps[-1].get("loss") if side == "measured" and steps else None


@dataclass(frozen=True)
class Metric:
    """One quantity per run: ``value(metrics, "predicted" | "measured")``; ``better``: lower | higher."""

    title: str
    unit: str
    better: str
    value: Callable[[dict, str], Any]

    def of(self, r: Run, side: str) -> float | None:
        try:
            v = self.value(r.metrics or {}, side)
        except (KeyError, TypeError, IndexError, AttributeError):
            return None
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None

    @property
    def heading(self) -> str:
        arrow = "↓" if self.better == "lower" else "↑"
        return f"{self.title}{f' ({self.unit})' if self.unit else ''} {arrow}"


PANELS: list[Metric] = [
    Metric("step time", "ms", "lower", lambda m, s: m["latency_s"][s] and m["latency_s"][s] * 1e3),
    Metric("throughput", "samples/s", "higher", lambda m, s: m["throughput_samples_per_s"][s]),
    Metric("bubble fraction", "", "lower", lambda m, s: m["bubble_fraction"][s]),
    Metric("final train loss", "", "lower", _final_loss),
    Metric("peak activations (max worker)", "MiB", "lower",
           lambda m, s: _max(m["per_worker"]["peak_activation_bytes"][s], 2**20)),
    Metric("peak memory (max worker)", "MiB", "lower",
           lambda m, s: _max(m["per_worker"]["peak_memory_bytes"][s], 2**20)),
    Metric("resident weights (max worker)", "stages", "lower",
           lambda m, s: _max(m["per_worker"]["weights_peak_resident"][s])),
    Metric("traffic received (all workers)", "MiB", "lower", _sum_kinds),
]


def all_reduces(r: Run) -> bool:
    """Whether the run's replicas all-reduce gradients (some stage has more than one owner: DDP,
    LPP with G > 1): bytes that ``metrics.json``'s traffic (point-to-point messages per kind) does
    not count."""
    m = r.metrics or {}
    owned = ((m.get("per_worker") or {}).get("weights_owned") or {}).get("predicted")
    stages = (m.get("run") or {}).get("stages") or r.config.get("stages")
    if owned and isinstance(stages, int):
        return sum(x or 0 for x in owned) > stages
    g = (m.get("run") or {}).get("G") or r.config.get("G")
    return r.scheme in ("ddp", "lpp") and isinstance(g, int) and g > 1


#: said under the traffic charts where some run all-reduces
ALL_REDUCE_NOTE = ("Traffic counts the point-to-point messages per kind (activations, gradients, weights, weight"
                   " gradients); the gradient all-reduce among replicas ({runs}) is not counted, so no run is starred"
                   " on traffic.")


def best(values: Sequence[float | None], better: str) -> set[int]:
    """The indices of the best values (ties: all of them); none when fewer than two runs have a
    value or all have the same one."""
    have = [(i, v) for i, v in enumerate(values) if v is not None]
    if len(have) < 2:
        return set()
    top = min(v for _, v in have) if better == "lower" else max(v for _, v in have)
    tol = 1e-9 * max(1.0, abs(top))
    win = {i for i, v in have if abs(v - top) <= tol}
    return set() if len(win) == len(have) else win


def _hover_best(better: str) -> str:
    return f"★ best ({better} is better)"


def _go():  # noqa: ANN202
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    return go, make_subplots


def _bars(fig: Any, row: int, col: int, labels: list[str], sides: dict[str, list], better: str, unit: str,
          legend: bool, judge: bool = True) -> None:
    """Predicted beside measured bars of one metric; the best measured run (else predicted) starred
    (``judge``: false where the values do not compare runs fairly)."""
    go, _ = _go()
    judged = "measured" if sum(v is not None for v in sides["measured"]) >= 2 else "predicted"
    win = best(sides[judged], better) if judge else set()
    for side, colour in SIDES:
        ys = sides[side]
        star = [side == judged and i in win for i in range(len(ys))]
        fig.add_trace(go.Bar(
            x=labels, y=ys, name=side, legendgroup=side, showlegend=legend, marker_color=colour,
            marker_line_color=["#000" if s else colour for s in star], marker_line_width=[2 if s else 0 for s in star],
            text=["★" if s else "" for s in star], textposition="outside", cliponaxis=False,
            textfont=dict(size=16, color="#b8860b"),
            customdata=[_hover_best(better) if s else "" for s in star],
            hovertemplate=f"%{{x}}<br>{side}: %{{y:.4g}} {unit}<br>%{{customdata}}<extra></extra>"), row=row, col=col)


def _layout(fig: Any, height: int, **kw: Any) -> Any:
    fig.update_layout(height=height, margin=dict(l=60, r=20, t=60, b=40), template="plotly_white",
                      font=dict(size=12), hoverlabel=dict(namelength=-1), **kw)
    return fig


def comparison(runs: list[Run]) -> Any:
    """One panel per metric (:data:`PANELS`), predicted beside measured per run; the best starred."""
    _, make_subplots = _go()
    labels = [r.label for r in runs]
    cols = 4
    rows = math.ceil(len(PANELS) / cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[p.heading for p in PANELS],
                        vertical_spacing=0.3, horizontal_spacing=0.06)
    for i, p in enumerate(PANELS):
        sides = {s: [p.of(r, s) for r in runs] for s, _ in SIDES}
        _bars(fig, i // cols + 1, i % cols + 1, labels, sides, p.better, p.unit, legend=i == 0,
              judge=not (p.title.startswith("traffic") and any(map(all_reduces, runs))))
    fig.update_xaxes(tickangle=-30, automargin=True)
    fig.update_yaxes(rangemode="tozero")
    longest = max(map(len, labels), default=0)
    return _layout(fig, 330 * rows + 6 * longest, barmode="group",
                   legend=dict(orientation="h", x=0, xanchor="left", y=1.12, yanchor="bottom"))


def coinciding(runs: list[Run], rtol: float = COINCIDE_RTOL) -> list[list[int]]:
    """Groups (of indices, two or more) of runs whose train and validation loss curves are equal
    within ``rtol`` at every step."""
    def curve(r: Run) -> list[tuple[int, float]]:
        m = r.metrics or {}
        return ([(s["step"], s["loss"]) for s in m.get("steps") or []]
                + [(-v["step"], v["val_loss"]) for v in m.get("val") or []])

    def equal(a: list, b: list) -> bool:
        return bool(a) and len(a) == len(b) and all(
            sa == sb and (la == lb or abs(la - lb) <= rtol * max(abs(la), abs(lb), 1e-12))
            for (sa, la), (sb, lb) in zip(a, b))

    curves = [curve(r) for r in runs]
    groups: list[list[int]] = []
    seen: set[int] = set()
    for i in range(len(runs)):
        if i in seen:
            continue
        g = [i] + [j for j in range(i + 1, len(runs)) if j not in seen and equal(curves[i], curves[j])]
        if len(g) > 1:
            groups.append(g)
            seen.update(g)
    return groups


DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x", "cross", "star", "hexagon")


def losses(runs: list[Run]) -> tuple[Any, list[list[str]]]:
    """Training loss per step (lines) and validation loss (markers), one colour per run. Curves
    that coincide (:func:`coinciding`) are drawn one over another, each thinner, with its own dash
    and staggered markers, under one legend title naming them. Each recovery from a lost worker is
    a dotted vertical line at its step (:func:`_recovery_marks`). Returns the figure and the groups'
    labels."""
    go, _ = _go()
    fig = go.Figure()
    groups = coinciding(runs)
    member = {i: (gi, k, len(g)) for gi, g in enumerate(groups) for k, i in enumerate(g)}
    finals = [PANELS[3].of(r, "measured") for r in runs]
    win = best(finals, "lower")
    for i, r in enumerate(runs):
        colour = PALETTE[i % len(PALETTE)]
        steps = (r.metrics or {}).get("steps") or []
        val = (r.metrics or {}).get("val") or []
        gi, k, n = member.get(i, (None, 0, 1))
        group = f"coincide{gi}" if gi is not None else r.label
        title = (", ".join(runs[j].label for j in groups[gi]) + " coincide") if gi is not None else None
        name = r.label + (" ★ best final loss" if i in win else "")
        xs, ys = [s["step"] for s in steps], [s["loss"] for s in steps]
        # in a group of n, member k is drawn thinner than the one under it, and marks every n-th step
        sizes = [7 if (j + k) % n == 0 else 0 for j in range(len(xs))] if n > 1 else 0
        fig.add_trace(go.Scatter(
            x=xs, y=ys, name=name, legendgroup=group, legendgrouptitle_text=title if k == 0 else None,
            mode="lines+markers" if n > 1 else "lines",
            line=dict(color=colour, width=max(1.5, 6.0 - 2.0 * k) if n > 1 else 2, dash=DASHES[k % len(DASHES)]),
            marker=dict(symbol=SYMBOLS[k % len(SYMBOLS)], size=sizes, color=colour),
            opacity=0.55 if n > 1 and k == 0 else 1.0,
            hovertemplate=f"{r.label}<br>step %{{x}}: train loss %{{y:.5g}}"
                          + (f"<br>{title}" if title else "") + ("<br>★ best final loss" if i in win else "")
                          + "<extra></extra>"))
        if val:
            fig.add_trace(go.Scatter(
                x=[v["step"] for v in val], y=[v["val_loss"] for v in val], name=f"{r.label} (validation)",
                legendgroup=group, mode="markers", showlegend=False,
                marker=dict(symbol=SYMBOLS[k % len(SYMBOLS)] + "-open", size=11 + 3 * (n - 1 - k), color=colour,
                            line=dict(width=2, color=colour)),
                hovertemplate=f"{r.label}<br>step %{{x}}: validation loss %{{y:.5g}}<extra></extra>"))
        _recovery_marks(fig, r, colour, group, xs, ys)
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="loss (lines: train, open markers: validation)")
    _layout(fig, 440, legend=dict(groupclick="toggleitem"))
    return fig, [[runs[j].label for j in g] for g in groups]


def recovery_text(r: Run, rec: dict) -> str:
    """One recovery of ``metrics.json``'s ``recoveries`` in words (the mark's tooltip)."""
    before, after = (rec.get("workers") or [None, None])[:2]
    lost = ", ".join(map(str, rec.get("lost_ranks") or []))
    return (f"{r.label}: recovered at step {rec.get('step')} in {rec.get('seconds')} s"
            f"<br>lost rank {lost} during {rec.get('during', 'a training step')}: W {before} -> {after}, "
            f"{rec.get('scheme_before')} -> {rec.get('scheme_after')}"
            f"<br>state from {rec.get('from')}, {rec.get('steps_lost')} steps lost"
            f"<br>cause: {rec.get('cause')}")


def _recovery_marks(fig: Any, r: Run, colour: str, group: str, xs: list, ys: list) -> None:
    """Each recovery of the run (``metrics.json``'s ``recoveries``, :mod:`launcher.lightning.recovery`)
    as a dotted vertical line at its step, labelled with its seconds, and a marker on the loss curve
    whose tooltip (and the label's) says its cause, the workers and schemes, and where the state came from."""
    go, _ = _go()
    recs = [rec for rec in (r.metrics or {}).get("recoveries") or [] if isinstance(rec.get("step"), (int, float))]
    if not recs:
        return
    at = dict(zip(xs, ys))
    texts = [recovery_text(r, rec) for rec in recs]
    for rec, text in zip(recs, texts):
        fig.add_vline(x=rec["step"], line=dict(color=colour, dash="dot", width=1.5),
                      annotation=dict(text=f"recovered, {rec.get('seconds')} s", hovertext=text,
                                      font=dict(color=colour, size=11), textangle=-90),
                      annotation_position="top left")
    steps = [rec["step"] for rec in recs]
    fig.add_trace(go.Scatter(
        x=steps, y=[at.get(x, min(ys) if ys else 0) for x in steps], name=f"{r.label} (recoveries)",
        legendgroup=group, mode="markers", showlegend=False,
        marker=dict(symbol="x-thin-open", size=14, color=colour, line=dict(width=3, color=colour)),
        hovertext=texts, hoverinfo="text"))


def traffic(runs: list[Run]) -> Any | None:
    """Bytes received per message kind (all workers), predicted beside measured, one panel per
    kind any run sent; the run with the least measured traffic of a kind starred."""
    _, make_subplots = _go()
    labels = [r.label for r in runs]

    def mib(r: Run, kind: str, side: str) -> float | None:
        tb = ((r.metrics or {}).get("per_worker") or {}).get("traffic_bytes") or {}
        vals = [v for v in ((tb.get(kind) or {}).get(side) or []) if v is not None]
        return sum(vals) / 2**20 if vals else (0.0 if tb else None)

    kinds = [k for k in KINDS if any(mib(r, k, s) for r in runs for s, _ in SIDES)]
    if not kinds:
        return None
    cols = min(4, len(kinds))
    rows = math.ceil(len(kinds) / cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[f"{k} (MiB) ↓" for k in kinds],
                        vertical_spacing=0.3, horizontal_spacing=0.06)
    for i, k in enumerate(kinds):
        sides = {s: [mib(r, k, s) for r in runs] for s, _ in SIDES}
        _bars(fig, i // cols + 1, i % cols + 1, labels, sides, "lower", "MiB", legend=i == 0,
              judge=not any(map(all_reduces, runs)))
    fig.update_xaxes(tickangle=-30, automargin=True)
    fig.update_yaxes(rangemode="tozero")
    longest = max(map(len, labels), default=0)
    return _layout(fig, 330 * rows + 6 * longest, barmode="group",
                   legend=dict(orientation="h", x=0, xanchor="left", y=1.12, yanchor="bottom"))


# ---- timelines from trace.json ----------------------------------------------------------------

#: a job kind's colour; a stage's shade of it runs from dark (first stage) to light (last)
KIND_COLOURS = {"F": (31, 119, 180), "B": (255, 127, 14), "I": (214, 39, 40), "W": (44, 160, 44)}
KIND_NAMES = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}
WAIT_COLOUR, SYNC_COLOUR, OUTSIDE_COLOUR = "#3a3a3a", "#8c8c8c", "#e3d7b8"
OTHER_NAMES = {"wait": "waiting for a message", "sync": "gradient exchange / end of step",
               "outside": "outside the engine"}


def _shade(kind: str, stage: int, stages: int) -> str:
    r, g, b = KIND_COLOURS.get(kind, (120, 120, 120))
    t = stage / max(1, stages - 1)  # 0 .. 1
    f = -0.25 + 0.75 * t  # darker .. lighter
    mix = (lambda c: c + (255 - c) * f) if f >= 0 else (lambda c: c * (1 + f))
    return "#%02x%02x%02x" % tuple(round(mix(c)) for c in (r, g, b))


@dataclass
class Trace:
    """A run's ``trace.json``, read: per side (``measured``, ``predicted``) its events, in ms."""

    jobs: dict[str, list[dict]]
    other_events: dict[str, dict[str, list[dict]]]  # wait, sync, outside -> side -> events
    other: dict[str, Any]
    workers: int
    stages: int

    @property
    def njobs(self) -> int:
        return sum(map(len, self.jobs.values()))

    def end(self, side: str) -> float:
        """When the side's last event ends (ms)."""
        evs = self.jobs[side] + [e for c in self.other_events.values() for e in c[side]]
        return max((e["end"] for e in evs), default=0.0)

    def last_job(self, side: str) -> float:
        return max((e["end"] for e in self.jobs[side]), default=0.0)


def read_trace(t: dict[str, Any]) -> Trace:
    """The events of a Chrome trace as the runs write it: pid 1 measured, pid 2 predicted (or as
    their ``process_name`` metadata says), tid = worker, ts/dur in microseconds from the step's
    start; cat ``job`` (args stage, microbatch, kind), ``wait``, ``sync``, ``outside`` (the rest,
    ``step`` and flows among them, are not drawn)."""
    events = t.get("traceEvents") or []
    side_of = {1: "measured", 2: "predicted"}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            n = str((e.get("args") or {}).get("name", "")).lower()
            for s in ("measured", "predicted"):
                if s in n:
                    side_of[e.get("pid")] = s
    out: dict[str, dict[str, list]] = {c: {"measured": [], "predicted": []} for c in ("job", "wait", "sync", "outside")}
    workers, stages = 0, 0
    for e in events:
        side = side_of.get(e.get("pid"))
        cat = e.get("cat")
        if e.get("ph") != "X" or side is None or cat not in out:
            continue
        a = e.get("args") or {}
        start = float(e.get("ts", 0)) / 1e3
        dur = float(e.get("dur", 0)) / 1e3
        tid = int(e.get("tid", 0))
        workers = max(workers, tid + 1)
        name = str(e.get("name", cat))
        ev = {"worker": tid, "start": start, "dur": dur, "end": start + dur, "name": name, "detail": ""}
        if cat == "wait" and a.get("bytes") is not None:
            of = f", stage {a['stage']}, micro-batch {a['microbatch']}" if (a.get("microbatch") or 0) >= 0 \
                and "stage" in a else ""  # weight kinds: micro-batch -1
            ev["detail"] = f" ({a['bytes']} bytes{of})"
        if cat == "job":
            ev["kind"] = str(a.get("kind") or name[:1])
            ev["stage"], ev["microbatch"] = a.get("stage"), a.get("microbatch")
            if isinstance(ev["stage"], int):
                stages = max(stages, ev["stage"] + 1)
        out[cat][side].append(ev)
    other = dict(t.get("otherData") or {})
    workers = max(workers, int(other.get("W") or 0))
    stages = max(stages, int(other.get("stages") or 0))
    return Trace(out["job"], {c: out[c] for c in ("wait", "sync", "outside")}, other, workers, stages)


def timeline(run: Run, tr: Trace) -> Any:
    """The run's measured step above its predicted one: a bar per job on its worker's row (colour:
    kind, shade: stage), waits (a dark strip along the job they held up), the end-of-step exchange
    (grey) and the framework's time outside the engine (beige), one time axis in ms from the
    step's start; a dashed line at each side's step time. Job names are in the hover, and in a bar
    only where it is wide enough to hold one."""
    _, make_subplots = _go()
    other = tr.other
    W = max(1, tr.workers)
    step_ms = {"measured": other.get("measured_step_ms"), "predicted": other.get("predicted_step_ms")}
    titles = [f"{side}" + (f": step {step_ms[side]:.4g} ms" if isinstance(step_ms[side], (int, float)) else "")
              for side in ("measured", "predicted")]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.1 if W <= 8 else 0.06,
                        subplot_titles=titles)
    legend: set[str] = set()  # the legend groups shown so far: each once, for both panels
    for row, side in enumerate(("measured", "predicted"), start=1):
        _outside_bars(fig, row, side, tr, legend)
        _job_bars(fig, row, side, tr, legend)
        _strips(fig, row, side, tr, legend)
        ms = step_ms[side]
        if isinstance(ms, (int, float)):
            fig.add_vline(x=ms, row=row, col=1, line=dict(dash="dash", color="#444", width=1))
    xmax = max([tr.end("measured"), tr.end("predicted")]
               + [v for v in step_ms.values() if isinstance(v, (int, float))]) * 1.02 or 1.0
    return _timeline_layout(fig, run, W, xmax)


def _outside_bars(fig: Any, row: int, side: str, tr: Trace, legend: set[str]) -> None:
    """The side's time outside the engine, a bar per stretch on its worker's row."""
    go, _ = _go()
    evs = tr.other_events["outside"][side]
    if not evs:
        return
    fig.add_trace(go.Bar(
        orientation="h", y=[e["worker"] for e in evs], base=[e["start"] for e in evs],
        x=[e["dur"] for e in evs], width=0.5, name=OTHER_NAMES["outside"], legendgroup="outside",
        showlegend="outside" not in legend, marker=dict(color=OUTSIDE_COLOUR),
        customdata=[[e["name"], e["start"], e["dur"]] for e in evs],
        hovertemplate="<b>%{customdata[0]}</b> on w%{y}<br>start %{customdata[1]:.3f} ms, duration"
                      f" %{{customdata[2]:.3f}} ms<extra>{side}</extra>"), row=row, col=1)
    legend.add("outside")


def _job_bars(fig: Any, row: int, side: str, tr: Trace, legend: set[str]) -> None:
    """The side's jobs, a trace per kind (F, B, I, W first): a bar per job, shaded by its stage."""
    go, _ = _go()
    by_kind: dict[str, list[dict]] = {}
    for e in tr.jobs[side]:
        by_kind.setdefault(e["kind"], []).append(e)
    for kind in sorted(by_kind, key=lambda k: ("FBIW".find(k) % 5, k)):
        # stage 0 first: the legend shows a trace's first colour, the kind's darkest
        evs = sorted(by_kind[kind], key=lambda e: (e["stage"] if isinstance(e["stage"], int) else 0, e["start"]))
        name = f"{kind} ({KIND_NAMES.get(kind, kind)})"
        fig.add_trace(go.Bar(
            orientation="h", y=[e["worker"] for e in evs], base=[e["start"] for e in evs],
            x=[e["dur"] for e in evs], width=0.8, name=name, legendgroup=kind, showlegend=kind not in legend,
            marker=dict(color=[_shade(kind, e["stage"] if isinstance(e["stage"], int) else 0, tr.stages)
                               for e in evs], line=dict(width=0.5, color="rgba(0,0,0,0.45)")),
            text=[f"{kind.lower()}{e['stage']}" for e in evs], textposition="inside", insidetextanchor="middle",
            textangle=0, textfont=dict(size=9, color="#111"),
            customdata=[[e["name"], e["stage"], e["microbatch"], e["start"], e["dur"], e["end"]] for e in evs],
            hovertemplate="<b>%{customdata[0]}</b> on w%{y}<br>stage %{customdata[1]}, micro-batch "
                          "%{customdata[2]}<br>start %{customdata[3]:.3f} ms, duration %{customdata[4]:.3f} ms"
                          f"<extra>{side}</extra>"), row=row, col=1)
        legend.add(kind)


def _strips(fig: Any, row: int, side: str, tr: Trace, legend: set[str]) -> None:
    """The side's end-of-step exchange (grey bars) and waits for messages (dark strips)."""
    go, _ = _go()
    # a wait: a strip along the bottom of the job it held up (the job's label stays readable)
    for cat, colour, width, offset in (("sync", SYNC_COLOUR, 0.5, None), ("wait", WAIT_COLOUR, 0.16, 0.22)):
        evs = tr.other_events[cat][side]
        if not evs:
            continue
        fig.add_trace(go.Bar(
            orientation="h", y=[e["worker"] for e in evs], base=[e["start"] for e in evs],
            x=[e["dur"] for e in evs], width=width, offset=offset, name=OTHER_NAMES[cat], legendgroup=cat,
            showlegend=cat not in legend, marker=dict(color=colour),
            customdata=[[e["name"], e["start"], e["dur"], e["detail"]] for e in evs],
            hovertemplate="<b>%{customdata[0]}</b> on w%{y}%{customdata[3]}<br>start %{customdata[1]:.3f} ms,"
                          f" duration %{{customdata[2]:.3f}} ms<extra>{side}</extra>"), row=row, col=1)
        legend.add(cat)


def _timeline_layout(fig: Any, run: Run, W: int, xmax: float) -> Any:
    """One time axis up to ``xmax`` ms, a row per worker, and a height that fits ``W`` rows per panel."""
    fig.update_xaxes(range=[0, xmax], showgrid=True)
    fig.update_xaxes(title_text="time from the step's start (ms)", row=2, col=1)
    ticks = list(range(W)) if W <= 32 else list(range(0, W, max(1, W // 16)))
    fig.update_yaxes(autorange="reversed", tickvals=ticks, ticktext=[f"w{w}" for w in ticks], fixedrange=True,
                     showgrid=False, zeroline=False)
    row_px = 22 if W > 4 else 30
    height = 2 * (row_px * W + 50) + 170
    fig = _layout(fig, height, barmode="overlay", bargap=0, uniformtext=dict(minsize=8, mode="hide"), dragmode="zoom",
                  # the run's name and the legend on one line under the mode bar, the panels' titles below
                  legend=dict(orientation="h", x=1, xanchor="right", yref="container", y=1 - 30 / height,
                              yanchor="top"),
                  title=dict(text=f"<b>{run.label}</b>", x=0.01, xanchor="left", yref="container",
                             y=1 - 33 / height, yanchor="top", font=dict(size=14)))
    fig.update_layout(margin=dict(t=100))
    return fig


#: the two steps' colours (the earlier, the later) in :func:`two_steps`
STEP_COLOURS = ("#6baed6", "#fd8d3c")


def two_steps(run: Run) -> Any | None:
    """The run's predicted steady state under ``step_overlap=post_validation`` (``metrics.json``'s
    ``step_cost_s.two_steps_post_validation``): two consecutive steps as they interleave, a bar
    per job on its worker's row (colour: the step), a dashed line at each step's end; ``None``
    when the run has none."""
    two = ((run.metrics or {}).get("step_cost_s") or {}).get("two_steps_post_validation")
    if not two or not two.get("jobs"):
        return None
    go, _ = _go()
    fig = go.Figure()
    W = 1 + max(int(j[0]) for j in two["jobs"])
    for k, colour in enumerate(STEP_COLOURS):
        jobs = [j for j in two["jobs"] if j[4] == k]
        fig.add_trace(go.Bar(
            orientation="h", y=[j[0] for j in jobs], base=[j[5] * 1e3 for j in jobs],
            x=[(j[6] - j[5]) * 1e3 for j in jobs], width=0.8, name=f"step {k + 1}",
            marker=dict(color=colour, line=dict(width=0.5, color="rgba(0,0,0,0.45)")),
            text=[f"{j[3].lower()}{j[1]}" for j in jobs], textposition="inside", insidetextanchor="middle",
            textangle=0, textfont=dict(size=9, color="#111"),
            customdata=[[f"{j[3]}({j[1]},{j[2]})", j[5] * 1e3, (j[6] - j[5]) * 1e3] for j in jobs],
            hovertemplate="<b>%{customdata[0]}</b> on w%{y}<br>start %{customdata[1]:.3f} ms, duration"
                          f" %{{customdata[2]:.3f}} ms<extra>step {k + 1}</extra>"))
    for k, end in enumerate(two.get("ends") or []):
        fig.add_vline(x=end * 1e3, line=dict(dash="dash", color=STEP_COLOURS[k], width=1.5))
    ticks = list(range(W)) if W <= 32 else list(range(0, W, max(1, W // 16)))
    fig.update_xaxes(title_text="time from the earlier step's first job (ms)", showgrid=True)
    fig.update_yaxes(autorange="reversed", tickvals=ticks, ticktext=[f"w{w}" for w in ticks], fixedrange=True,
                     showgrid=False, zeroline=False)
    return _layout(fig, (22 if W > 4 else 30) * W + 170, barmode="overlay", bargap=0,
                   uniformtext=dict(minsize=8, mode="hide"),
                   title=dict(text=f"<b>{run.label}</b>", x=0.01, xanchor="left", font=dict(size=14)))
