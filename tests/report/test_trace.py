"""``trace.json``: the measured step beside the predicted one in Chrome's trace event format
(:mod:`launcher.report.trace`), checked by a validator of that format; and one real run's."""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict

import pytest

from helpers.cli import SMALL_RUN, run_launcher
from launcher.report import trace
from launcher.schedule import make_schedule, simulate

META = {"process_name": "name", "thread_name": "name", "process_sort_index": "sort_index",
        "thread_sort_index": "sort_index"}


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def problems(t: dict) -> list[str]:
    """What in ``t`` breaks the Chrome trace event format's JSON object form (as Perfetto and
    chrome://tracing read it), or the layout :mod:`launcher.report.trace` promises."""
    out: list[str] = []
    if not isinstance(t.get("traceEvents"), list):
        return ["traceEvents is not a list"]
    if t.get("displayTimeUnit") not in ("ms", "ns"):
        out.append("displayTimeUnit is not ms or ns")
    other = t.get("otherData")
    if not isinstance(other, dict) or set(trace.OTHER_KEYS) - set(other):
        out.append(f"otherData lacks {sorted(set(trace.OTHER_KEYS) - set(other or {}))}")
    elif other["clock"] not in ("shared monotonic", "per-worker"):
        out.append(f"clock {other['clock']!r}")
    slices: dict[tuple, list] = defaultdict(list)
    flows: dict[object, list] = defaultdict(list)
    named_pids, named_tids = set(), set()
    for i, e in enumerate(t["traceEvents"]):
        ph = e.get("ph")
        if not isinstance(e.get("name"), str) or not isinstance(e.get("pid"), int) or not isinstance(e.get("tid"), int):
            out.append(f"event {i}: name, pid and tid must be a string and ints: {e}")
            continue
        if ph == "M":
            key = META.get(e["name"])
            v = (e.get("args") or {}).get(key) if key else None
            if (key is None or (key == "name" and not isinstance(v, str))
                    or (key == "sort_index" and not isinstance(v, int))):
                out.append(f"event {i}: bad metadata {e}")
            if e["name"] == "process_name":
                named_pids.add(e["pid"])
            if e["name"] == "thread_name":
                named_tids.add((e["pid"], e["tid"]))
        elif ph == "X":
            if not (_num(e.get("ts")) and _num(e.get("dur")) and e["ts"] >= 0 and e["dur"] >= 0):
                out.append(f"event {i}: X needs numbers ts, dur >= 0: {e}")
            elif not isinstance(e.get("cat"), str) or not isinstance(e.get("args", {}), dict):
                out.append(f"event {i}: cat must be a string and args an object: {e}")
            else:
                slices[(e["pid"], e["tid"])].append(e)
        elif ph in ("s", "f"):
            if not _num(e.get("ts")) or not isinstance(e.get("id"), (int, str)) or not isinstance(e.get("cat"), str):
                out.append(f"event {i}: a flow needs ts, id and cat: {e}")
            elif ph == "f" and e.get("bp") != "e":
                out.append(f"event {i}: a flow's end binds to its enclosing slice (bp e): {e}")
            else:
                flows[(e["cat"], e["name"], e["id"])].append(e)
        else:
            out.append(f"event {i}: unexpected ph {ph!r}")
    for key, evs in slices.items():
        if key[0] not in named_pids or key not in named_tids:
            out.append(f"pid/tid {key} has no process_name or thread_name")
        stack: list[int] = []  # in integer nanoseconds: microseconds with 3 decimals
        for e in sorted(evs, key=lambda e: (round(e["ts"] * 1e3), -round(e["dur"] * 1e3))):
            a, b = round(e["ts"] * 1e3), round((e["ts"] + e["dur"]) * 1e3)
            while stack and stack[-1] <= a:
                stack.pop()
            if stack and b > stack[-1]:
                out.append(f"{key}: {e['name']} at {e['ts']} overlaps its enclosing slice partially")
            stack.append(b)
    for key, evs in flows.items():
        phs = sorted(e["ph"] for e in evs)
        if phs != ["f", "s"]:
            out.append(f"flow {key}: {phs}, not one s and one f")
            continue
        s, f = sorted(evs, key=lambda e: e["ph"] != "s")
        if f["ts"] < s["ts"]:
            out.append(f"flow {key} ends before it starts")
        for e in (s, f):  # each end lies in a slice of its thread
            if not any(x["ts"] <= e["ts"] <= x["ts"] + x["dur"] for x in slices[(e["pid"], e["tid"])]):
                out.append(f"flow {key}: its {e['ph']} is in no slice of its thread")
    return out


def _jobs(t: dict, pid: int) -> list[tuple]:
    return [(e["tid"], e["args"]["kind"], e["args"]["stage"], e["args"]["microbatch"])
            for e in t["traceEvents"] if e["ph"] == "X" and e["pid"] == pid and e["cat"] == "job"]


def _worker(r: int, host: str = "h") -> dict:
    """Worker r of two, a hand-made step on a clock starting at 100 s: F(r,0) then B(r,0), worker
    1 waiting for worker 0's activation, worker 0 for worker 1's gradient; one wait overlaps
    the end of its job (clipped) and one is too short to draw."""
    base = 100.0 + 0.001 * r
    jobs = [[r, 0, "F", base + 0.001, base + 0.003, 0.0015], [r, 0, "B", base + 0.004, base + 0.008, 0.002]]
    if r == 0:
        waits = [["grad", 1, 64, 0, 0, base + 0.0045, base + 0.0085, 2],  # runs 0.5 ms past B(0,0): clipped
                 ["grad", 1, 64, 0, 0, base + 0.0046, base + 0.004601, 3]]  # 1 us: not drawn
        sends = [[1, "act", 128, base + 0.0025]]
    else:
        waits = [["act", 0, 128, 0, 0, base + 0.0011, base + 0.0013, 1]]
        sends = [[2, "grad", 64, base + 0.0075], [3, "grad", 64, base + 0.0076]]
    return {"worker": r, "host": host, "step": 3, "start": base + 0.0005, "end": base + 0.010,
            "sync": [base + 0.0085, base + 0.010], "allreduce": [base + 0.009, base + 0.0095], "jobs": jobs,
            "waits": waits, "sends": sends, "span": [base, base + 0.012]}


RUN = {"scheme": "gpipe", "G": 1, "R": 2, "W": 2, "stages": 2, "microbatches": 1}


def test_trace_layout_is_a_valid_chrome_trace():
    tl = simulate(make_schedule("gpipe", 2, 1, G=1, R=2, durations={"F": 1e-3, "B": 2e-3}))
    t = json.loads(json.dumps(trace.build([_worker(0), _worker(1)], tl, RUN, step=3, predicted_step_s=0.009)))
    assert problems(t) == []
    o = t["otherData"]
    assert list(o) == list(trace.OTHER_KEYS) and o["clock"] == "shared monotonic" and o["step"] == 3
    assert o["measured_step_ms"] == pytest.approx(12.0) and o["predicted_step_ms"] == pytest.approx(9.0)
    meta = {(e["pid"], e["tid"], e["name"]): e["args"] for e in t["traceEvents"] if e["ph"] == "M"}
    assert (meta[(1, 0, "process_name")] == {"name": "measured"}
            and meta[(2, 0, "process_name")] == {"name": "predicted"})
    assert (meta[(1, 1, "thread_name")] == {"name": "worker 1"}
            and meta[(2, 1, "thread_sort_index")] == {"sort_index": 1})
    want = [(0, "F", 0, 0), (0, "B", 0, 0), (1, "F", 1, 0), (1, "B", 1, 0)]
    assert sorted(_jobs(t, 1)) == sorted(want) and sorted(_jobs(t, 2)) == sorted(want)
    x = {(e["pid"], e["tid"], e["name"]): e for e in t["traceEvents"] if e["ph"] == "X"}
    # worker 0 starts first: the origin; worker 1's F(1,0) 1 ms after its own start
    assert x[(1, 0, "step 3")]["ts"] == 0 and x[(1, 1, "F(1,0)")]["ts"] == pytest.approx(2000)
    f = x[(1, 1, "F(1,0)")]["args"]
    assert f == pytest.approx({"stage": 1, "microbatch": 0, "kind": "F", "start_ms": 2.0, "dur_ms": 2.0,
                               "work_ms": 1.5, "wait_ms": 0.5})
    assert x[(1, 1, "wait act from 0")]["args"] == pytest.approx(
        {"kind": "act", "from": 0, "bytes": 128, "stage": 0, "microbatch": 0, "dur_ms": 0.2})
    clipped = x[(1, 0, "wait grad from 1")]
    assert clipped["ts"] + clipped["dur"] == pytest.approx(x[(1, 0, "B(0,0)")]["ts"] + x[(1, 0, "B(0,0)")]["dur"])
    waits = [e for e in t["traceEvents"] if e["ph"] == "X" and e["cat"] == "wait"]
    assert len(waits) == 2  # the 1 us one is not drawn
    outside = [e["dur"] for e in t["traceEvents"] if e.get("cat") == "outside" and e["tid"] == 0]
    assert outside == pytest.approx([500, 2000])  # the Lightning step around the engine's
    assert {e["name"] for e in t["traceEvents"] if e.get("cat") == "sync"} == {"gradient exchange", "all-reduce",
                                                                               "end of step"}
    ends = {e["pid"]: e for e in t["traceEvents"] if e["name"] == "end of step"}
    assert list(ends) == [2] and ends[2]["ts"] + ends[2]["dur"] == pytest.approx(9000)
    flows = Counter((e["ph"], e["id"]) for e in t["traceEvents"] if e.get("cat") == "message")
    assert flows == {(ph, i): 1 for ph in "sf" for i in (1, 2, 3)}


def test_workers_on_several_hosts_keep_their_own_clocks_and_draw_no_flows():
    t = trace.build([_worker(0, "a"), _worker(1, "b")], None, RUN, step=3)
    assert problems(t) == []
    assert t["otherData"]["clock"] == "per-worker" and t["otherData"]["predicted_step_ms"] is None
    steps = [e for e in t["traceEvents"] if e["ph"] == "X" and e["cat"] == "step"]
    assert [e["ts"] for e in steps] == [0, 0] and {e["pid"] for e in t["traceEvents"]} == {1}
    assert not [e for e in t["traceEvents"] if e.get("cat") == "message"]


def test_the_validator_catches_partial_overlap_and_unpaired_flows():
    t = trace.build([_worker(0)], None, RUN, step=1)
    bad = [{"ph": "X", "name": "a", "cat": "job", "pid": 1, "tid": 0, "ts": 1.0, "dur": 5.0, "args": {}},
           {"ph": "X", "name": "b", "cat": "job", "pid": 1, "tid": 0, "ts": 3.0, "dur": 5.0, "args": {}},
           {"ph": "s", "name": "act", "cat": "message", "id": 99, "pid": 1, "tid": 0, "ts": 2.0}]
    t["traceEvents"] += [{**e, "tid": 7} for e in bad]
    found = problems(t)
    assert any("overlaps" in p for p in found) and any("flow" in p for p in found)
    assert any("no process_name or thread_name" in p for p in found)


SMALL = [*SMALL_RUN, "trainer.val_check_interval=1000", "logger=none"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_gpipe_run_writes_its_last_step_as_a_trace(tmp_path):
    run = tmp_path / "run"
    p = run_launcher("strategy=gpipe", "G=1", "R=4", *SMALL, "trainer.max_steps=2", f"hydra.run.dir={run}",
                     cwd=tmp_path, timeout=230)
    assert p.returncode == 0, p.stderr[-3000:]
    t, m = json.loads((run / "trace.json").read_text()), json.loads((run / "metrics.json").read_text())
    assert problems(t) == []
    o = t["otherData"]
    assert {k: o[k] for k in ("scheme", "G", "R", "W", "stages", "microbatches", "step", "clock")} == {
        "scheme": "gpipe", "G": 1, "R": 4, "W": 4, "stages": 4, "microbatches": 4, "step": 2,
        "clock": "shared monotonic"}
    # every job of the plan exactly once, on its worker (gpipe: stage s on worker s), measured and predicted
    want = sorted((s, k, s, b) for s in range(4) for b in range(4) for k in "FB")
    assert sorted(_jobs(t, 1)) == want and sorted(_jobs(t, 2)) == want
    assert o["predicted_step_ms"] == pytest.approx(m["latency_s"]["predicted"] * 1e3, rel=1e-9)
    assert o["measured_step_ms"] == pytest.approx(m["steps"][-1]["step_s"] * 1e3, rel=1e-9)
    steps = {e["pid"]: [] for e in t["traceEvents"]}
    for e in t["traceEvents"]:
        if e["ph"] == "X" and e["cat"] == "step":
            steps[e["pid"]].append(e["dur"] / 1e3)
    assert len(steps[1]) == 4 and max(steps[1]) == pytest.approx(o["measured_step_ms"], abs=1e-3)
    assert steps[2] == pytest.approx([o["predicted_step_ms"]] * 4, abs=1e-3)
    cats = Counter((e["pid"], e.get("cat")) for e in t["traceEvents"] if e["ph"] == "X")
    assert cats[(1, "sync")] == 4 and cats[(1, "outside")] >= 4
    kinds = {e["args"]["kind"] for e in t["traceEvents"] if e.get("cat") == "wait"}
    assert kinds <= {"act", "grad"}
    # 12 activations and 12 gradients cross between workers: a flow each
    assert Counter(e["name"] for e in t["traceEvents"] if e["ph"] == "s") == {"act": 12, "grad": 12}
