"""``python -m launcher.compare``: the comparison page built from real runs (and, for the
timelines, a hand-written 16-worker trace), and rendered in a real headless Chromium (when
Debian's chromium is installed; .ci/run installs it)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from helpers.cli import SMALL_RUN, run_launcher
from launcher.compare import charts
from launcher.compare import page as page_mod
from launcher.compare.runs import Run, label

pytestmark = pytest.mark.timeout(240)

SMALL = [*SMALL_RUN, "trainer.max_steps=4", "trainer.val_check_interval=2"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


#: ``python <args>``: the launcher's sweeps (-m launcher) and the comparison page (-m launcher.compare)
run = partial(run_launcher, command=(sys.executable,), timeout=200)


def hand_trace(W: int, B: int, measured_ms: float, predicted_ms: float) -> dict:
    """A GPipe step (stage s on worker s) of B micro-batches on W workers in the layout runs write
    in ``trace.json``: pid 1 measured, pid 2 predicted, tid = worker, ts/dur in microseconds from the
    step's start; jobs (cat job), waits nested in them (cat wait), the end of step (cat sync), the
    framework around the engine (cat outside), whole steps (cat step) and message flows."""
    ev: list[dict] = []
    for pid, name in ((1, "measured"), (2, "predicted")):
        ev.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
        for w in range(W):
            ev.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": w, "args": {"name": f"worker {w}"}})

    def x(pid: int, w: int, cat: str, name: str, ts: float, dur: float, **args) -> None:
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": w, "ts": ts, "dur": dur, "args": args})

    for pid, step_us, lead in ((1, measured_ms * 1e3, 0.08), (2, predicted_ms * 1e3, 0.0)):
        t0 = lead * step_us  # measured: the framework before the engine
        unit = (0.85 - lead) * step_us / ((W + B - 1) * 3)  # F takes one unit, B two
        for w in range(W):
            x(pid, w, "step", "step 4", 0, step_us, step=4)
            if pid == 1:
                x(pid, w, "outside", "outside the engine", 0, t0)
            for b in range(B):
                f0 = t0 + (w + b) * unit
                x(pid, w, "job", f"F({w},{b})", f0, unit, stage=w, microbatch=b, kind="F")
                if pid == 1 and w and b == 0:
                    x(pid, w, "wait", f"wait act from {w - 1}", f0, unit / 3, kind="act", **{"from": w - 1},
                      bytes=2048, stage=w, microbatch=b)
                    ev.append({"ph": "f", "bp": "e", "cat": "message", "name": "act", "id": w, "pid": 1, "tid": w,
                               "ts": f0 + unit / 3})
                b0 = t0 + (W + B - 1) * unit + (W - 1 - w + b) * 2 * unit
                x(pid, w, "job", f"B({w},{b})", b0, 2 * unit, stage=w, microbatch=b, kind="B")
            end = t0 + (W + B - 1) * 3 * unit
            x(pid, w, "sync", "gradient exchange" if pid == 1 else "end of step", end,
              (0.9 if pid == 1 else 1.0) * step_us - end)
            if pid == 1:
                x(pid, w, "outside", "outside the engine", 0.9 * step_us, 0.1 * step_us)
    other = {"scheme": "gpipe", "G": 1, "R": W, "W": W, "stages": W, "microbatches": B, "step": 4,
             "measured_step_ms": measured_ms, "predicted_step_ms": predicted_ms, "clock": "shared monotonic"}
    return {"traceEvents": ev, "displayTimeUnit": "ms", "otherData": other}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("compare")
    sweep = tmp / "sweep"
    # two schemes that train, and one point that is invalid (ddp needs W = microbatches)
    p = run("-m", "launcher", "-m", "strategy=gpipe,fslpp,ddp", "G=2", "R=2", "microbatches=8", *SMALL[:1], *SMALL[2:],
            f"hydra.sweep.dir={sweep}", cwd=tmp)
    assert p.returncode == 2, p.stderr[-3000:]  # the invalid points are reported, the others ran
    return sweep


@pytest.fixture(scope="module")
def page(sweep) -> Path:
    out = sweep.parent / "page" / "index.html"
    p = run("-m", "launcher.compare", str(sweep), "-o", str(out), cwd=sweep.parent)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"wrote {out}"
    return out


@pytest.fixture(scope="module")
def traced(sweep) -> Path:
    """The page of the sweep's two runs beside a copy of one with a hand-written 16-worker trace."""
    runs = sweep.parent / "traced"
    for n in ("0", "1"):
        shutil.copytree(sweep / n, runs / n, ignore=shutil.ignore_patterns("wandb", "checkpoints"))
    shutil.copytree(sweep / "0", runs / "hand", ignore=shutil.ignore_patterns("wandb", "checkpoints"))
    m = json.loads((runs / "hand" / "metrics.json").read_text())
    m["config"]["seed"] = 1  # a third label: "gpipe seed=1"
    m["recoveries"] = [RECOVERY]  # as a run with fault.restarts that lost a worker writes it
    (runs / "hand" / "metrics.json").write_text(json.dumps(m))
    pred = m["latency_s"]["predicted"] * 1e3
    (runs / "hand" / "trace.json").write_text(json.dumps(hand_trace(16, 16, m["latency_s"]["measured"] * 1e3, pred)))
    out = sweep.parent / "traced.html"
    page_mod.build([runs], out)
    return out


#: one entry of ``metrics.json``'s ``recoveries`` (launcher/lightning/recovery.py writes them)
RECOVERY = {"generation": 1, "cause": "rank 2 failed while running no job (between steps): the process died "
            "(killed by SIGKILL)", "lost_ranks": [2], "step": 3, "seconds": 0.21, "steps_lost": 0, "redone": 1,
            "during": "a training step", "from": "memory", "moved_stages": 0, "moved_bytes": 0,
            "scheme_before": "ddp G=4 R=1 (W=4)", "scheme_after": "lpp G=3 R=1 (W=3)",
            "chosen_by": "the planner's choice", "workers": [4, 3]}


def test_recoveries_are_marked_on_the_loss_curve():
    """A vertical line at each recovery's step, labelled with its seconds; its tooltip (the label's and
    a marker's on the curve) says the cause, the workers and schemes and where the state came from."""
    steps = {"steps": [{"step": i, "loss": 5.0 - i} for i in range(1, 5)], "val": []}
    runs = [Run(Path("."), "a", "ok", metrics={**steps, "recoveries": [RECOVERY]}), Run(Path("."), "b", "ok",
                                                                                         metrics=steps)]
    fig, _ = charts.losses(runs)
    lines = [(sh.x0, sh.x1, sh.yref, sh.line.dash) for sh in fig.layout.shapes]
    assert lines == [(3, 3, "y domain", "dot")]  # the run without recoveries has none
    (note,) = fig.layout.annotations
    assert note.text == "recovered, 0.21 s" and note.x == 3
    marks = [t for t in fig.data if t.name.endswith("(recoveries)")]
    assert len(marks) == 1 and list(marks[0].x) == [3] and list(marks[0].y) == [2.0]
    for text in (note.hovertext, marks[0].hovertext[0]):
        assert "recovered at step 3 in 0.21 s" in text and "killed by SIGKILL" in text and "W 4 -> 3" in text
        assert "state from memory, 0 steps lost" in text


def cells(html: str, status: str = r"\w+") -> list[list[str]]:
    """The table's rows (of the given status), each the list of its cells' inner HTML."""
    return [re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)
            for row in re.findall(rf'<tr class="{status}">(.*?)</tr>', html, re.S)]


def test_labels_say_what_differs():
    def r(cfg: dict, point: str = "") -> Run:
        return Run(Path("."), "x", "ok", metrics={"run": {"point": point}}, config=cfg)

    def five(lr: float = 0.003) -> list[dict]:
        return [{"strategy": {"name": s, "ownership": "seed"}, "G": g, "R": rr, "W": 8, "stages": 8,
                 "model": {"lr": lr, "seq_len": 64}, "data": {"seq_len": 64}}
                for s, g, rr in (("ddp", 8, 1), ("fsdp", 8, 1), ("gpipe", 1, 8), ("lpp", 2, 4), ("fslpp", 2, 4))]

    assert label([r(c) for c in five()]) == ["ddp G=8 R=1", "fsdp G=8 R=1", "gpipe G=1 R=8", "lpp G=2 R=4",
                                             "fslpp G=2 R=4"]
    # an lr sweep of one scheme; keys that vary together (seq_len twice) appear once; W = G * R is left out
    cfgs = five(0.003)[2:3] + five(0.01)[2:3]
    assert label([r(c) for c in cfgs]) == ["gpipe lr=0.003", "gpipe lr=0.01"]
    cfgs = five(0.003)[2:3] + five(0.01)[3:4]
    assert label([r(c) for c in cfgs]) == ["gpipe G=1 R=8 lr=0.003", "lpp G=2 R=4 lr=0.01"]
    a, b = five()[3], five()[3]
    a.update(G=1, W=4), b.update(G=2, W=8)
    a["model"]["seq_len"] = a["data"]["seq_len"] = 32
    assert label([r(a), r(b)]) == ["lpp G=1 seq_len=32", "lpp G=2 seq_len=64"]
    # identical runs: a suffix
    assert label([r(c) for c in five()[:1] * 3]) == ["ddp #1", "ddp #2", "ddp #3"]
    assert label([r(five()[0])]) == ["ddp"]


def test_best_and_coinciding():
    assert charts.best([3.0, 1.0, None, 2.0], "lower") == {1}
    assert charts.best([3.0, 1.0, 3.0], "higher") == {0, 2}
    assert charts.best([1.0, 1.0], "lower") == set() and charts.best([1.0, None], "lower") == set()
    curve = lambda d: {"steps": [{"step": i, "loss": 5 - i + d} for i in range(4)], "val": []}  # noqa: E731
    runs = [Run(Path("."), str(i), "ok", metrics=curve(d)) for i, d in enumerate((0, 1e-9, 0.1, 0, 0.1))]
    assert charts.coinciding(runs) == [[0, 1, 3], [2, 4]]
    # replicas all-reduce (bytes the traffic does not count): a stage with more than one owner
    owned = lambda xs: Run(Path("."), "x", "ok", metrics={"run": {"stages": 8},  # noqa: E731
                                                          "per_worker": {"weights_owned": {"predicted": xs}}})
    assert charts.all_reduces(owned([8] * 8)) and charts.all_reduces(owned([2] * 8))
    assert not charts.all_reduces(owned([1] * 8))


@pytest.mark.slow
def test_page_has_the_table_charts_and_diagrams(page, sweep):
    html = page.read_text()
    rows = re.findall(r'<tr class="(\w+)">', html)
    assert rows.count("ok") == 2 and rows.count("invalid") == 1, rows
    # labelled by what differs (here: only the scheme), the directory in its own column
    table = cells(html)
    assert [(row[0], row[1]) for row in table] == [("gpipe", "sweep/0"), ("fslpp", "sweep/1"), ("ddp", "sweep/2")]
    # the best run of each metric column is starred, with its direction in the header
    for c, better in page_mod.BETTER.items():
        col = page_mod.COLUMNS.index(c)
        assert f"{c} {'↓' if better == 'lower' else '↑'}</th>" in html
        ok = [re.findall(r'<td([^>]*)>', row)[col] for row in re.findall(r'<tr class="ok">(.*?)</tr>', html, re.S)]
        keys = [float(re.search(r'data-v="([^"]*)"', td).group(1)) for td in ok]
        starred = [k for td, k in zip(ok, keys) if 'class="best"' in td]
        target = min(keys) if better == "lower" else max(keys)
        assert starred == ([] if len(set(keys)) == 1 else [target]), (c, ok)
    assert "<h2>Best by metric</h2>" in html and "fastest step (measured): <b>" in html
    for title in ("Predicted beside measured", "Loss", "Traffic per message kind (received)"):
        assert f"<h2>{title}</h2>" in html
    # interactive: plotly.js inline once, no script from the network, one plot per chart
    assert html.count("<script>/**\n* plotly.js v") == 1
    assert not re.search(r"<script[^>]*\bsrc=", html), "the page must work offline"
    # each trained run's two steps back to back, as the same programs would run them overlapped (issue 49)
    assert html.count("<h2>Two steps back to back, predicted with step_overlap=post_validation: ") == 2
    assert len(re.findall(r"Plotly\.newPlot\(", html)) == 3 + 2 + html.count('class="timeline"')
    for better in ("lower", "higher"):  # the best bars' hover (in the figures' JSON, "★" escaped)
        assert json.dumps(f"★ best ({better} is better)") in html
    # gpipe and fslpp compute the same thing: their loss curves coincide, and the page says so
    assert "gpipe, fslpp coincide" in html
    # no PNG charts any more (the page holds everything); pipeline.png where a run has no trace.json
    assert not list(page.parent.glob("*.png"))
    ok = [sweep / n for n in ("0", "1")]
    with_trace = [d for d in ok if (d / "trace.json").exists()]
    assert html.count('class="timeline"') == len(with_trace)
    assert len(re.findall(r'<img alt="pipeline ', html)) == len(ok) - len(with_trace)
    if len(with_trace) < len(ok):
        assert "Its time axis is in seconds and ends where the last predicted job does" in html


@pytest.mark.slow
def test_timeline_of_a_trace(traced, sweep):
    html = traced.read_text()
    assert [row[0] for row in cells(html)] == ["gpipe seed=0", "fslpp seed=0", "gpipe seed=1"]
    assert "<h2>Timelines: measured above predicted</h2>" in html
    timelines = re.findall(r'<figure class="timeline">(.*?)</figure>', html, re.S)
    real = [n for n in ("0", "1") if (sweep / n / "trace.json").exists()]
    assert len(timelines) == 1 + len(real)
    hand = next(t for t in timelines if "traced/hand: step 4 of gpipe seed=1" in t)
    assert "16 workers, 16 stages, 16 micro-batches" in hand
    fig = json.loads(re.search(r"Plotly\.newPlot\(\s*\"[^\"]+\",\s*(\[.*?\]),\s*\{", hand, re.S).group(1))
    jobs = [t for t in fig if t.get("legendgroup") in ("F", "B")]
    assert sum(len(t["y"]) for t in jobs) == 2 * 2 * 16 * 16  # every job, measured and predicted
    assert {t["yaxis"] for t in jobs} == {"y", "y2"} and {t["xaxis"] for t in jobs} == {"x", "x2"}
    assert all(t["orientation"] == "h" and "micro-batch" in t["hovertemplate"] for t in jobs)
    # labels inside bars only where they fit; one time axis for both panels
    assert '"uniformtext":{"minsize":8,"mode":"hide"}' in hand.replace(" ", "")
    assert '"matches":"x2"' in hand.replace(" ", "")
    assert 'w15' in hand and "waiting for a message" in hand and "outside the engine" in hand


@pytest.mark.slow
def test_an_unreadable_trace_falls_back_to_the_diagram(sweep, tmp_path):
    shutil.copytree(sweep / "1", tmp_path / "run", ignore=shutil.ignore_patterns("wandb", "checkpoints"))
    bad = {"traceEvents": [{"ph": "X", "cat": "job", "name": "F(0,0)", "pid": 1, "tid": 0, "ts": None, "dur": 1}]}
    (tmp_path / "run" / "trace.json").write_text(json.dumps(bad))
    html = page_mod.build([tmp_path / "run"], tmp_path / "page.html").read_text()
    assert 'class="timeline"' not in html and len(re.findall(r'<img alt="pipeline ', html)) == 1
    assert "trace.json could not be read (TypeError" in html


CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                "--enable-logging=stderr", "--v=0"]


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")
def test_page_renders_in_headless_chromium(page, traced, tmp_path):
    def chromium(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([CHROMIUM, *CHROME_FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                               "--virtual-time-budget=20000", *args], capture_output=True, text=True, timeout=120)

    # sorted on load by measured step time, descending (the same sort a click on its header does)
    col = page_mod.COLUMNS.index("step ms meas")
    for html in (page, traced):
        p = chromium("--dump-dom", f"{html.as_uri()}#sort=-{col}")
        assert p.returncode == 0, p.stderr[-2000:]
        dom = p.stdout
        assert f'data-sorted="-{col}"' in dom
        keys = [re.findall(r'data-v="([^"]*)"', row)[col]
                for row in re.findall(r'<tr class="ok">(.*?)</tr>', dom, re.S)]
        assert len(keys) >= 2 and [float(k) for k in keys] == sorted((float(k) for k in keys), reverse=True)
        console = [line for line in p.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
        assert not console, console
        # every chart drew: one plotly root and its SVG layers per figure, bars and legends in them
        plots = len(re.findall(r"Plotly\.newPlot\(", html.read_text()))
        assert len(re.findall(r'class="[^"]*\bjs-plotly-plot\b', dom)) == plots
        assert len(re.findall(r'<svg class="main-svg"', dom)) >= 2 * plots
        assert len(re.findall(r'class="point"', dom)) > 20 and 'class="legendtext"' in dom
        assert 'data-title="Zoom"' in dom and 'data-title="Share chart' not in dom  # nothing leaves the machine
        # the hand run's recovery: a vertical line and its label drawn on the loss chart
        assert ("recovered, 0.21 s" in dom) == (html == traced)

    shot = tmp_path / "page.png"
    p = chromium("--window-size=1400,4000", f"--screenshot={shot}", traced.as_uri())
    assert p.returncode == 0 and shot.stat().st_size > 50_000, p.stderr[-2000:]
