"""``metrics.json`` of a training run: predicted beside measured, per step, per worker, per kind.

Pure Python (no torch): the Lightning layer gathers what every worker measured and hands it here
with the lowered step. The prediction is the simulator's, fed with what this run's own workers measured
(:mod:`launcher.report.measured_costs`): seconds per job kind (CPU seconds on CPU workers), what a
message took, each worker's end of step and its time outside the engine; the simulated programs
are replayed on the cores the workers shared (:mod:`launcher.schedule.cores`), so the prediction
is in seconds.

Keys (the comparison dashboard reads them):

- ``run``: scheme, G, R, W, stages, microbatches, order, batch_size; ``config``: the resolved config;
- ``status``: ``ok``, or ``interrupted`` (stopped by SIGINT/SIGTERM: ``steps`` and ``val`` up to the stop,
  measured only, and ``error``, the line the command printed); ``failed``/``invalid`` runs write
  ``failed.json``/``invalid.json`` instead;
- ``steps``: per step ``loss``, ``step_s`` (wall, slowest worker), ``samples_per_s``; ``val``: per
  validation ``step`` and ``val_loss``;
- ``latency_s``, ``throughput_samples_per_s``, ``bubble_fraction``: ``{"predicted", "measured"}``
  (measured = the median over the steps after the first);
- ``step_cost_s``: what a step costs back to back (:mod:`launcher.schedule.overlap`):
  ``step_overlap`` (the rule the run followed), ``predicted`` and ``measured`` (as
  ``latency_s``: behind the barrier a step costs the replayed step, its end-of-step exchange and
  the time outside the engine), and ``predicted_post_validation``: the same programs and measured
  times under post-validation's chain (issue 49; on the cores the workers shared, with their
  work at each step's end, where they were fewer than the workers; under
  ``step_overlap=post_validation`` (gpipe, lpp with G=1) the run does, and ``step_overlap`` and
  ``measured`` are then its own, :mod:`launcher.lightning.step_overlap`);
  ``predicted_steady``: ``{"none", "post_validation"}``, both rules' steady states from the same
  inputs (the same model: their ratio is what overlapping is predicted to save; post_validation's
  with the run's own rolled-back steps taken again, ``post_validation.redo_s``, when it ran them);
  ``cpu_s``: a step's CPU seconds over all workers, ``{"predicted", "measured"}`` (the replayed
  work; the workers' process CPU, the median after the first step);
  ``two_steps_post_validation``: that steady state's last two steps as they interleave,
  ``{"ends": [s, s], "jobs": [[worker, stage, microbatch, kind, step, start_s, end_s], ...]}``
  (null past :data:`TWO_STEPS_MAX_JOBS` jobs a step), which the comparison page draws;
- ``profile``: ``durations_s`` per job kind (the compute thread's CPU seconds on CPU workers),
  ``stage_durations_s`` (per stage, the same of its own jobs: the prediction uses these),
  ``modules`` (each module's profiled cost when ``partition`` cut the stages by it, else null),
  ``message_cpu_s`` (on CPU workers, the communication threads' CPU per message moved during the
  jobs: activations, gradients, weight copies, partial sums sent; null without one), ``comm_s`` (what a
  message between workers took while its receiver waited, the median; else one mean activation
  over the link), ``link`` (``latency_s``, ``bytes_per_s`` of a ping-pong between workers 0 and 1;
  null with one worker), ``cores`` (the cores the workers shared, null with a processor each),
  ``outside_s`` (a step's seconds outside the engine per worker, the mean: CPU seconds on CPU
  workers), ``bytes`` per stage (``params``,
  ``grads``, ``optimizer``, ``activation``: x_s^b of one micro-batch; ``saved``: what its forward's
  autograd graph holds for one micro-batch), the input the planner reads;
- ``per_worker``: lists indexed by worker, each ``{"predicted", "measured"}``: ``bubble_fraction``,
  ``peak_activations`` (count) and ``peak_activation_bytes``, ``weights_owned``,
  ``weights_peak_resident``, ``traffic_count`` and ``traffic_bytes`` (per message kind, received),
  ``peak_memory_bytes`` (measured only: RSS on CPU, ``max_memory_allocated`` on GPU);
- ``diagram``: the PNG of the predicted timeline, beside this file (null when ``png`` leaves it out).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..schedule import Timeline, activations
from ..schedule.cores import Replayed, job_work, replay
from ..schedule.link import Link, exchanges
from ..schedule.lowering import weight_arrivals
from ..schedule.overlap import last_two_steps, steady_state
from ..schedule.program import KINDS, Lowered
from ..schedule.simulate import Schedule
from .measured_costs import (
    end_seconds,
    job_seconds,
    message_cpu_seconds,
    message_seconds,
    outside_seconds,
    round_seconds,
    shared_cores,
    shared_reduce,
    stage_job_seconds,
)


def _median_after_first(xs: Sequence[float]) -> float:
    return statistics.median(xs[1:] if len(xs) > 1 else xs) if xs else 0.0


def activation_peaks(tl: Timeline, act_bytes: Sequence[Sequence[int]],
                     saved_bytes: Sequence[Sequence[int]] | None = None,
                     recomputed: Sequence[bool] | None = None) -> list[float]:
    """Peak bytes of live activations per worker on the timeline (:mod:`launcher.schedule.activations`):
    ``x_s^b`` from the start of ``F(s,b)`` to the end of the backward that consumes it, plus,
    given ``saved_bytes``, each forward's autograd graph (``recomputed``: per forward job)."""
    saved = (lambda s, b: saved_bytes[s][b]) if saved_bytes is not None else None
    return activations.activation_peaks(tl, lambda s, b: act_bytes[s][b], saved, recomputed)


def traffic(lowered: Lowered, msg_bytes: Sequence[int]) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Messages and bytes each worker receives, per kind, as planned."""
    counts = {k: [0] * lowered.workers for k in KINDS}
    nbytes = {k: [0] * lowered.workers for k in KINDS}
    for m in lowered.messages:
        counts[m.kind][m.dst] += 1
        nbytes[m.kind][m.dst] += msg_bytes[m.mid]
    return counts, nbytes


def build(
    *,
    config: Mapping[str, Any],
    run: Mapping[str, Any],
    lowered: Lowered,
    per_rank: Sequence[Mapping[str, Any]],
    msg_bytes: Sequence[int],
    act_bytes: Sequence[Sequence[int]],
    stage_bytes: Mapping[str, Sequence[int]],
    steps: Sequence[Mapping[str, Any]],
    val: Sequence[Mapping[str, Any]],
    samples_per_step: int,
    module_costs: Sequence[Mapping[str, float]] | None = None,
    saved_bytes: Sequence[Sequence[int]] | None = None,
    recomputed: Sequence[bool] | None = None,
) -> tuple[dict[str, Any], Timeline]:
    """The metrics record and the predicted timeline (for the diagram).

    ``per_rank``: each worker's ``{"rank", "records", "peak_memory_bytes", "memory_kind"}``, in rank
    order; ``steps``: per step ``loss`` and ``step_s``; ``module_costs``: each module's profile
    (:class:`~launcher.split.cost.ModuleCost` as a dict) when the stages were cut by it, kept in the
    profile so the planner can search the partition too; ``saved_bytes`` (per stage and
    micro-batch) and ``recomputed`` (per forward job): the forwards' autograd graphs, counted in
    the predicted peak activation bytes as the workers measure them.
    """
    W = lowered.workers
    ranks = [r for r in per_rank if r["rank"] < W]
    measured = _measure(ranks, lowered.timeline.schedule, act_bytes)
    replayed, tl, work, tails = _predict(lowered, ranks, measured, stage_bytes["grads"])
    predicted_s = replayed.seconds
    measured_s = _median_after_first([s["step_s"] for s in steps])
    bubble, bubble_per_worker = _bubble_fractions(replayed.busy, predicted_s, W, _measured_bubbles(ranks, steps))
    return {
        "run": dict(run),
        "config": dict(config),
        "status": "ok",
        "steps": [dict(s) for s in steps],
        "val": [dict(v) for v in val],
        "latency_s": {"predicted": predicted_s, "measured": measured_s},
        "throughput_samples_per_s": {"predicted": samples_per_step / predicted_s if predicted_s else None,
                                     "measured": samples_per_step / measured_s if measured_s else None},
        "bubble_fraction": bubble,
        "step_cost_s": _step_costs(tl, measured, predicted_s, measured_s, work, tails, _redo_seconds(ranks))
        | {"cpu_s": _cpu_per_step(ranks, work, tails, _redo_seconds(ranks))},
        "profile": _profile(measured, module_costs, stage_bytes),
        "per_worker": _per_worker(lowered, ranks, tl, msg_bytes, act_bytes, saved_bytes, recomputed, bubble_per_worker),
        "memory_kind": ranks[0]["memory_kind"] if ranks else None,
        "diagram": "pipeline.png",
    }, tl


@dataclass(frozen=True)
class _Measured:
    """What this run's own workers measured: the prediction's inputs, reported as the ``profile``."""

    durations: dict[str, float]  # seconds per job kind
    per_stage: list[dict[str, float]]  # the same, per stage
    link: Link | None  # a ping-pong between workers 0 and 1
    comm_s: float  # what a message between workers took
    round_s: float  # what a round of the end-of-step exchange took
    cores: int | None  # the cores the workers shared
    outside_s: list[float]  # per worker, a step's seconds outside the engine
    message_cpu: float | None  # on CPU workers, the communication threads' CPU per message
    shared_reduce: bool  # the replicas all-reduce through shared memory


def _measure(ranks: Sequence[Mapping[str, Any]], step: Schedule, act_bytes: Sequence[Sequence[int]]) -> _Measured:
    """The times the prediction takes from the workers' records."""
    kinds = step.space.kinds
    durations = job_seconds(ranks, kinds)
    # each stage's own measured times: an uneven cut has uneven stages, and the prediction follows it
    per_stage = stage_job_seconds(ranks, kinds, step.S)
    link = next((Link(**r["link"]) for r in ranks if r.get("link")), None)
    # a dependency across workers waits for a message: what one took here while its receiver
    # waited, or else one mean activation over the link
    act_mean = sum(map(sum, act_bytes)) / max(1, sum(map(len, act_bytes)))
    comm_s = message_seconds(ranks)
    if comm_s is None:
        comm_s = link.seconds(act_mean) if link else 0.0
    return _Measured(durations, per_stage, link, comm_s, round_seconds(ranks, comm_s), shared_cores(ranks),
                     outside_seconds(ranks), message_cpu_seconds(ranks), shared_reduce(ranks))


def _predict(lowered: Lowered, ranks: Sequence[Mapping[str, Any]], measured: _Measured,
             grad_bytes: Sequence[int]) -> tuple[Replayed, Timeline, list[float], list[float]]:
    """The programs the workers ran, timed by what they measured and replayed on the cores they
    shared: the replay, its timeline (drawn and reported: what ran, as predicted), and the work
    it replayed: per job, and per worker at the step's end."""
    W = lowered.workers
    step = lowered.timeline.schedule
    # measured backwards include any recomputation: the replay adds none
    tl = replace(lowered.timeline, schedule=replace(step, stage_durations=measured.per_stage, recompute=frozenset()))
    timed = ({k: max(v, 1e-9) for k, v in measured.durations.items()}
             | {k: 1.0 for k in "FBIW" if k not in step.space.kinds})
    delays = [e.rounds * measured.round_s for e in exchanges(tl, grad_bytes, measured.shared_reduce)]
    # after its jobs a worker finishes the step's exchange, then the framework's work around the
    # step (the loss is summed over every worker there, so each waits for all)
    tails = [e + o for e, o in zip(end_seconds(ranks), measured.outside_s)]
    work = job_work(tl, timed, measured.message_cpu, lowered.weight_cache)
    replayed = replay(tl, measured.cores or W, tails, [list(range(W))] * W, delays, durations=work,
                      comm=measured.comm_s, fetched=weight_arrivals(tl, lowered.weight_cache, lowered.prefetch))
    return replayed, replayed.timeline(tl), work, tails


#: the most jobs a step may have for ``two_steps_post_validation`` to be written (it lists every job twice)
TWO_STEPS_MAX_JOBS = 2000


def _redo_seconds(ranks: Sequence[Mapping[str, Any]]) -> list[float] | None:
    """Per worker, the seconds its rolled-back steps took again, per step (the run's own rollbacks
    under ``step_overlap=post_validation``); ``None`` when the run took none."""
    out = [(r.get("post_validation") or {}).get("redo_s", 0.0) / max(1, len(r["records"])) for r in ranks]
    return out if any(out) else None


def _cpu_per_step(ranks: Sequence[Mapping[str, Any]], work: Sequence[float], tails: Sequence[float],
                  redo: Sequence[float] | None) -> dict[str, float | None]:
    """A step's CPU seconds summed over the workers: ``predicted``, the work the prediction replays
    (jobs, step ends, redone steps); ``measured``, the workers' process CPU per step, the median over
    the steps after the first (``None`` where not measured). Unlike a step's wall time it does not
    move with what else the machine runs."""
    cpus = [r.get("cpus") or [] for r in ranks]
    n = min((len(c) for c in cpus), default=0)
    total = [sum(c[i] for c in cpus) for i in range(n)]
    return {"predicted": sum(work) + sum(tails) + sum(redo or ()),
            "measured": _median_after_first(total) if total else None}


def _step_costs(tl: Timeline, measured: _Measured, predicted_s: float, measured_s: float,
                work: Sequence[float], tails: Sequence[float], redo: Sequence[float] | None = None) -> dict[str, Any]:
    """``step_cost_s`` of the module docstring: the replayed programs (in seconds, ``comm`` the
    measured message time) stepped back to back under each rule. Where the workers shared fewer
    cores than they are, the same work as the replay's (per job, and each worker's step end) on
    those cores; else the replayed timeline, plus the most time a worker spends outside the engine
    per step (serial with its jobs under either rule). ``redo``: per worker, its rolled-back steps'
    seconds per step (post_validation only)."""
    timed = replace(tl, schedule=replace(tl.schedule, comm=measured.comm_s))
    # the global state is a few bytes: a hop takes the link's latency (the ping-pong's), not what an
    # activation took while its receiver waited (that includes the sender's descheduled time)
    hop = measured.link.latency_s if measured.link else measured.comm_s
    if measured.cores is not None and measured.cores < len(tails):
        ss = steady_state(timed, "post_validation", cores=measured.cores, work=work, tails=tails, redo=redo,
                          state_comm=hop)
        barrier = steady_state(timed, "none", cores=measured.cores, work=work, tails=tails, state_comm=hop)
        outside = 0.0
    else:
        ss = steady_state(timed, "post_validation", redo=redo, state_comm=hop)
        barrier = steady_state(timed, "none", state_comm=hop)
        outside = max(measured.outside_s, default=0.0)
    two = None
    if tl.schedule.space.N <= TWO_STEPS_MAX_JOBS:
        t0 = min(ss.starts[-2])
        two = {"ends": [e - t0 for e in ss.ends[-2:]], "jobs": [list(x) for x in last_two_steps(timed, ss)]}
    return {"step_overlap": "none", "predicted": predicted_s, "measured": measured_s,
            "predicted_post_validation": ss.step_cost + outside,
            "predicted_steady": {"none": barrier.step_cost + outside, "post_validation": ss.step_cost + outside},
            "two_steps_post_validation": two}


def _measured_bubbles(ranks: Sequence[Mapping[str, Any]], steps: Sequence[Mapping[str, Any]]) -> list[float | None]:
    """Per worker, the share of a step it spent outside its jobs (the sum of their wall times), the
    median over the steps after the first; ``None`` for a worker without records."""
    out: list[float | None] = []
    for r in ranks:
        recs = [x for x in r["records"] if x]
        per_step = [sum(j[3] for j in rec["measured_only"]["jobs"]) / max(s["step_s"], 1e-12)
                    for rec, s in zip(recs, steps)]
        out.append(1.0 - _median_after_first(per_step) if per_step else None)
    return out


def _bubble_fractions(busy: list[float], step_s: float, W: int,
                      measured: list[float | None]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The step's bubble fraction and each worker's, ``{"predicted", "measured"}``: predicted from
    the replay's ``busy`` wall seconds (slowed where workers share cores) in a step of ``step_s``;
    the step's measured one is the mean over the workers with records."""
    total = 1.0 - sum(busy) / (W * step_s) if step_s else 0.0
    known = [b for b in measured if b is not None]
    return ({"predicted": max(0.0, total), "measured": sum(known) / len(known) if known else None},
            {"predicted": [max(0.0, 1.0 - b / step_s) if step_s else 0.0 for b in busy], "measured": measured})


def _profile(measured: _Measured, module_costs: Sequence[Mapping[str, float]] | None,
             stage_bytes: Mapping[str, Sequence[int]]) -> dict[str, Any]:
    """The record's ``profile``: what the prediction was fed, the input the planner reads."""
    m = measured
    return {"durations_s": {k: m.durations.get(k) for k in ("F", "B", "I", "W")},
            "stage_durations_s": [{k: d.get(k) for k in ("F", "B", "I", "W")} for d in m.per_stage],
            "modules": [dict(c) for c in module_costs] if module_costs else None, "comm_s": m.comm_s,
            "message_cpu_s": m.message_cpu, "link": m.link.to_json() if m.link else None, "cores": m.cores,
            "shared_reduce": m.shared_reduce, "outside_s": sum(m.outside_s) / len(m.outside_s) if m.outside_s else 0.0,
            "bytes": {k: list(v) for k, v in stage_bytes.items()}}


def _per_worker(lowered: Lowered, ranks: Sequence[Mapping[str, Any]], tl: Timeline, msg_bytes: Sequence[int],
                act_bytes: Sequence[Sequence[int]], saved_bytes: Sequence[Sequence[int]] | None,
                recomputed: Sequence[bool] | None, bubble_fraction: dict[str, Any]) -> dict[str, Any]:
    """The record's ``per_worker``: the programs' (or the predicted timeline's) counts beside each
    worker's last record."""
    # the last step of a full batch: what the predicted message sizes are of (an epoch's last, smaller one is not)
    last = [next((x for x in reversed(r["records"]) if x and not x["measured_only"].get("short_batch")),
                 next((x for x in reversed(r["records"]) if x), None)) for r in ranks]

    def pw(key: str) -> dict[str, list]:
        return {"predicted": list(lowered.predicted[key]),
                "measured": [rec["per_worker"][key]["measured"] if rec else None for rec in last]}

    def received(key: str, planned: dict[str, list[int]]) -> dict[str, dict[str, list]]:
        """Per message kind, what the programs send each worker beside the ``key`` it counted."""
        return {k: {"predicted": planned[k],
                    "measured": [rec["measured_only"][key].get(k, 0) if rec else None for rec in last]}
                for k in KINDS}

    counts, nbytes = traffic(lowered, msg_bytes)
    traffic_count, traffic_bytes = received("recv_count", counts), received("recv_bytes", nbytes)
    peak_bytes_meas = [max((x["measured_only"]["peak_activation_bytes"] for x in r["records"] if x), default=None)
                       for r in ranks]
    return {
        "bubble_fraction": bubble_fraction,
        "peak_activations": pw("peak_activations"),
        "peak_activation_bytes": {"predicted": activation_peaks(tl, act_bytes, saved_bytes, recomputed),
                                  "measured": peak_bytes_meas},
        "weights_owned": pw("weights_owned"),
        "weights_peak_resident": pw("weights_peak_resident"),
        "traffic_count": traffic_count,
        "traffic_bytes": traffic_bytes,
        "peak_memory_bytes": {"predicted": None, "measured": [r["peak_memory_bytes"] for r in ranks]},
    }


def single_device(*, config: Mapping[str, Any], run: Mapping[str, Any], steps: Sequence[Mapping[str, Any]],
                  val: Sequence[Mapping[str, Any]], samples_per_step: int, peak_memory_bytes: int,
                  memory_kind: str) -> dict[str, Any]:
    """The metrics of a run under Lightning's default strategy (the reference): measured only."""
    measured_s = _median_after_first([s["step_s"] for s in steps])
    return {
        "run": dict(run), "config": dict(config), "status": "ok",
        "steps": [dict(s) for s in steps], "val": [dict(v) for v in val],
        "latency_s": {"predicted": None, "measured": measured_s},
        "throughput_samples_per_s": {"predicted": None,
                                     "measured": samples_per_step / measured_s if measured_s else None},
        "bubble_fraction": {"predicted": None, "measured": None},
        "per_worker": {"peak_memory_bytes": {"predicted": None, "measured": [peak_memory_bytes]}},
        "memory_kind": memory_kind,
        "diagram": None,
    }


def interrupted(config: Mapping[str, Any], run: Mapping[str, Any], steps: Sequence[Mapping[str, Any]],
                val: Sequence[Mapping[str, Any]], status: str, error: str) -> dict[str, Any]:
    """The metrics of a run stopped before its end (``status``: ``interrupted``): what rank 0
    measured up to the stop, step by step (its own wall time per step), measured only; ``error``:
    the line the command printed."""
    walls = [s["step_s"] for s in steps if s.get("step_s")]
    measured_s = _median_after_first(walls)
    samples = steps[-1].get("samples", 0) if steps else 0
    return {
        "run": dict(run), "config": dict(config), "status": status, "error": error,
        "steps": [{k: v for k, v in s.items() if k != "samples"} for s in steps], "val": [dict(v) for v in val],
        "latency_s": {"predicted": None, "measured": measured_s or None},
        "throughput_samples_per_s": {"predicted": None, "measured": samples / measured_s if measured_s else None},
        "bubble_fraction": {"predicted": None, "measured": None},
        "diagram": None,
    }


def write(metrics: Mapping[str, Any], directory: str | Path, name: str = "metrics.json") -> Path:
    from ..atomic import write_json

    return write_json(Path(directory) / name, metrics, indent=1)
