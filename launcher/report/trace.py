"""``trace.json``: one training step as a Chrome trace (open it in https://ui.perfetto.dev or
chrome://tracing), the step the workers measured beside the step the prediction replayed.

Pure Python (no torch). :func:`build` takes each worker's events of the traced step
(:meth:`launcher.runtime.engine.Engine.trace`: the last training step of the run, with the
Lightning step around it), the predicted timeline (``tl`` of :func:`launcher.report.metrics_json.build`,
in seconds) and the run's labels, and returns the Chrome Trace Event Format's JSON object form::

    {"traceEvents": [...], "displayTimeUnit": "ms",
     "otherData": {"scheme", "G", "R", "W", "stages", "microbatches", "step", "measured_step_ms",
                   "predicted_step_ms", "clock": "shared monotonic" | "per-worker"}}

Processes and threads: pid 1 is ``measured``, pid 2 ``predicted`` (``process_name`` and
``process_sort_index`` metadata); tid ``r`` is worker ``r`` in both (``thread_name`` ``worker r``,
``thread_sort_index`` r). Times (``ts``, ``dur``) are microseconds from the step's start.

Slices (``ph`` ``X``; on one tid they nest, never overlap partially):

- ``cat`` ``step``, name ``step N``: measured, the worker's Lightning training step (batch start to
  batch end, the framework and the optimizer included); predicted, ``[0, predicted_step_ms]``;
- ``cat`` ``job``, name ``F(s,b)`` / ``B(s,b)`` / ``I(s,b)`` / ``W(s,b)``: ``args`` ``stage``,
  ``microbatch``, ``kind``, ``start_ms``, ``dur_ms``; measured jobs also ``work_ms`` (without
  waits for peers, what the profile counts) and ``wait_ms`` (``dur_ms - work_ms``). A measured
  job runs from the engine taking it up (hand-overs and receive requests included) to its end;
- ``cat`` ``wait``, name ``wait <kind> from <rank>`` (kind ``act``, ``grad``, ``weights`` or
  ``wgrad``), measured only, nested in the job (or the gradient exchange) that blocked: ``args``
  ``kind``, ``from``, ``bytes``, ``stage``, ``microbatch`` (-1 for weight kinds), ``dur_ms``.
  Only waits of at least :data:`MIN_WAIT_S` are drawn (shorter ones found their data there);
- ``cat`` ``sync``: measured, ``gradient exchange`` (the end of the engine's step: gradient sums
  received, all-reduces, the last sends delivered) with a nested ``all-reduce`` where replicated
  stages are reduced; predicted, ``end of step`` from the last job of any worker to the
  predicted step's end (the exchange, the optimizer and the framework, as the prediction charges
  them: after every worker's jobs);
- ``cat`` ``outside``, name ``outside the engine``, measured only: the Lightning step before the
  engine starts and after it ends (the optimizer step, the loss all-reduce, callbacks).

Flows (``cat`` ``message``, ``name`` the message kind, ``id`` the plan's message id): ``ph`` ``s``
when the sender handed the data over (inside the sending job), ``ph`` ``f`` with ``bp`` ``e``
when the receiver had it (the end of its wait, inside the consuming job). Only between workers
of one host: their clocks agree.

Clocks: workers of one host share ``CLOCK_MONOTONIC`` (``time.perf_counter``), so every measured
track is placed from the earliest worker's step start (``clock`` ``shared monotonic``); workers
on several hosts are each placed from their own step start (``clock`` ``per-worker``), and no
flows are drawn. ``measured_step_ms`` is the traced step's wall time as ``metrics.json``'s
``steps`` report it (the slowest worker's step, each on its own clock); on one host the tracks'
extent can exceed it by how far apart the workers started. ``predicted_step_ms`` is
``metrics.json``'s ``latency_s.predicted`` in milliseconds, the replayed step's makespan.

On GPU workers the times are the host's: a job ends when its last call returned, which may be
before its kernels have run (a wait then includes the device's catch-up).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

MEASURED, PREDICTED = 1, 2
#: a receive that waited less than this found its data there (the call's own cost): no slice
MIN_WAIT_S = 20e-6
OUTSIDE = "outside the engine"
EXCHANGE = "gradient exchange"
ALLREDUCE = "all-reduce"
END_OF_STEP = "end of step"
#: the ``otherData`` keys, in order
OTHER_KEYS = ("scheme", "G", "R", "W", "stages", "microbatches", "step", "measured_step_ms", "predicted_step_ms",
              "clock")


def _ms(ns: int) -> float:
    return ns / 1e6


class _Track:
    """The slices of one (pid, tid), in integer nanoseconds from the step's start."""

    def __init__(self, pid: int, tid: int) -> None:
        self.pid, self.tid = pid, tid
        self.slices: list[tuple[int, int, str, str, dict]] = []

    def add(self, begin: int, end: int, name: str, cat: str, args: dict | None = None) -> None:
        self.slices.append((begin, max(begin, end), name, cat, args or {}))

    def events(self) -> list[dict[str, Any]]:
        """``X`` events, nested: a slice that starts inside another and would end after it is
        clipped to its end (parents first at equal starts: the longer one)."""
        out: list[dict[str, Any]] = []
        stack: list[int] = []  # ends of the open slices
        for begin, end, name, cat, args in sorted(self.slices, key=lambda x: (x[0], -x[1])):
            while stack and stack[-1] <= begin:
                stack.pop()
            if stack and end > stack[-1]:
                end = stack[-1]
            stack.append(end)
            if "dur_ms" in args:
                args["dur_ms"] = _ms(end - begin)
            out.append({"ph": "X", "name": name, "cat": cat, "pid": self.pid, "tid": self.tid, "ts": begin / 1e3,
                        "dur": (end - begin) / 1e3, "args": args})
        return out


def _job_args(s: int, b: int, kind: str, begin: int, end: int) -> dict[str, Any]:
    return {"stage": s, "microbatch": b, "kind": kind, "start_ms": _ms(begin), "dur_ms": _ms(end - begin)}


def _bounds(w: Mapping[str, Any]) -> tuple[float, float]:
    """A worker's step: its Lightning step when known, else the engine's."""
    span = w.get("span")
    return (span[0], span[1]) if span else (w["start"], w["end"])


def build(
    workers: Sequence[Mapping[str, Any] | None],
    timeline: Any = None,
    run: Mapping[str, Any] | None = None,
    *,
    step: int,
    predicted_step_s: float | None = None,
    measured_step_s: float | None = None,
) -> dict[str, Any]:
    """The trace object (see the module docstring).

    ``workers``: indexed by rank, each :meth:`Engine.trace`'s dict (``None`` for a rank without
    one) with ``span``, the Lightning step's ``[start, end]`` on the same clock, when known;
    ``timeline``: the predicted :class:`~launcher.schedule.simulate.Timeline` in seconds (None:
    no predicted process); ``run``: the labels of ``metrics.json``'s ``run``; ``step``: the traced
    step's number; ``predicted_step_s``: the predicted step (default: the timeline's last finish);
    ``measured_step_s``: the traced step's wall time (default: the longest worker step traced).
    """
    run = dict(run or {})
    traced = {w.get("worker", r): w for r, w in enumerate(workers) if w}
    hosts = {w.get("host") for w in traced.values()}
    shared = len(hosts) <= 1
    first = min((_bounds(w)[0] for w in traced.values()), default=0.0)
    sent: dict[int, tuple[int, int, str, int]] = {}  # message id -> (rank, ns, kind, bytes)
    got: dict[int, tuple[int, int]] = {}  # message id -> (rank, ns the receiver had it)
    tracks = [_measured_track(r, w, first if shared else _bounds(w)[0], step, sent, got)
              for r, w in sorted(traced.items())]
    flows = _flows(sent, got) if shared else []  # only one host's clocks agree
    if measured_step_s is None and traced:
        measured_step_s = max(_bounds(w)[1] - _bounds(w)[0] for w in traced.values())

    pred_ranks: list[int] = []
    if timeline is not None:
        last = max((timeline.finish[j] for prog in timeline.sequences for j in prog), default=0.0)
        if predicted_step_s is None:
            predicted_step_s = last
        tracks += _predicted_tracks(timeline, step, round(predicted_step_s * 1e9), round(last * 1e9))
        pred_ranks = list(range(len(timeline.sequences)))

    events = _metadata([(MEASURED, "measured", sorted(traced)), (PREDICTED, "predicted", pred_ranks)])
    for tr in tracks:
        events.extend(tr.events())
    events.extend(flows)
    other = {"scheme": run.get("scheme"), "G": run.get("G"), "R": run.get("R"), "W": run.get("W"),
             "stages": run.get("stages"), "microbatches": run.get("microbatches"), "step": step,
             "measured_step_ms": measured_step_s * 1e3 if measured_step_s is not None else None,
             "predicted_step_ms": predicted_step_s * 1e3 if predicted_step_s is not None else None,
             "clock": "shared monotonic" if shared else "per-worker"}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _measured_track(r: int, w: Mapping[str, Any], origin: float, step: int,
                    sent: dict[int, tuple[int, int, str, int]], got: dict[int, tuple[int, int]]) -> _Track:
    """Worker ``r``'s measured track, in nanoseconds from ``origin`` on its clock; the messages it
    handed over go into ``sent``, those it received into ``got`` (by message id)."""

    def ns(t: float) -> int:
        return round((t - origin) * 1e9)

    tr = _Track(MEASURED, r)
    s0, s1 = _bounds(w)
    tr.add(ns(s0), ns(s1), f"step {step}", "step", {"step": step, "dur_ms": 0.0})
    if w.get("span"):
        if w["start"] > s0:
            tr.add(ns(s0), ns(w["start"]), OUTSIDE, "outside", {"dur_ms": 0.0})
        if s1 > w["end"]:
            tr.add(ns(w["end"]), ns(s1), OUTSIDE, "outside", {"dur_ms": 0.0})
    for s, b, kind, t0, t1, work in w["jobs"]:
        a, e = ns(t0), ns(t1)
        args = _job_args(s, b, kind, a, e)
        args["work_ms"] = work * 1e3
        args["wait_ms"] = max(0.0, args["dur_ms"] - args["work_ms"])
        tr.add(a, e, f"{kind}({s},{b})", "job", args)
    for kind, peer, nbytes, s, b, t0, t1, mid in w["waits"]:
        if t1 - t0 >= MIN_WAIT_S:
            tr.add(ns(t0), ns(t1), f"wait {kind} from {peer}", "wait",
                   {"kind": kind, "from": peer, "bytes": nbytes, "stage": s, "microbatch": b, "dur_ms": 0.0})
        got[mid] = (r, ns(t1))
    for mid, kind, nbytes, at in w["sends"]:
        sent[mid] = (r, ns(at), kind, nbytes)
    if w.get("sync"):
        tr.add(ns(w["sync"][0]), ns(w["sync"][1]), EXCHANGE, "sync", {"dur_ms": 0.0})
    if w.get("allreduce"):
        tr.add(ns(w["allreduce"][0]), ns(w["allreduce"][1]), ALLREDUCE, "sync", {"dur_ms": 0.0})
    return tr


def _flows(sent: Mapping[int, tuple[int, int, str, int]], got: Mapping[int, tuple[int, int]]) -> list[dict[str, Any]]:
    """A flow per message both ends traced: from its hand-over to the receiver having it."""
    flows: list[dict[str, Any]] = []
    for mid in sorted(set(sent) & set(got)):
        src, at, kind, nbytes = sent[mid]
        dst, to = got[mid]
        common = {"cat": "message", "name": kind, "id": mid, "pid": MEASURED}
        flows.append({"ph": "s", **common, "tid": src, "ts": at / 1e3, "args": {"bytes": nbytes, "to": dst}})
        flows.append({"ph": "f", "bp": "e", **common, "tid": dst, "ts": max(at, to) / 1e3})
    return flows


def _predicted_tracks(timeline: Any, step: int, step_ns: int, last_ns: int) -> list[_Track]:
    """A track per worker of the predicted ``timeline`` (seconds): its jobs in a step of
    ``step_ns``, and the end of the step after the last job of any worker (``last_ns``)."""
    space = timeline.schedule.space
    tracks = []
    for r, prog in enumerate(timeline.sequences):
        tr = _Track(PREDICTED, r)
        tracks.append(tr)
        tr.add(0, step_ns, f"step {step}", "step", {"step": step, "dur_ms": 0.0})
        for j in prog:
            s, b, kind = space.job(j)
            a, e = round(timeline.start[j] * 1e9), round(timeline.finish[j] * 1e9)
            tr.add(a, e, f"{kind}({s},{b})", "job", _job_args(s, b, kind, a, e))
        if step_ns > last_ns:
            tr.add(last_ns, step_ns, END_OF_STEP, "sync", {"dur_ms": 0.0})
    return tracks


def _metadata(processes: Sequence[tuple[int, str, Sequence[int]]]) -> list[dict[str, Any]]:
    """Names and sort indices of each ``(pid, name, ranks)`` process with ranks, and of its threads."""
    events: list[dict[str, Any]] = []
    for pid, name, ranks in processes:
        if not ranks:
            continue
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for r in ranks:
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": r, "args": {"name": f"worker {r}"}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": r, "args": {"sort_index": r}})
    return events


def write(trace: Mapping[str, Any], directory: str | Path, name: str = "trace.json") -> Path:
    """Write ``trace`` into ``directory`` whole or not at all (:mod:`launcher.atomic`)."""
    from ..atomic import write_json

    return write_json(Path(directory) / name, trace, indent=None)
