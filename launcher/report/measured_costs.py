"""What a step costs on the real workers, from their step records: the simulator's inputs.

Pure Python (no torch). Every worker's record of a step (:func:`launcher.runtime.measure.worker_record`)
holds each job's work (its wall time less its waits for peers) and its process CPU time, the CPU
and wall time of the end of the step (gradient sums and all-reduces), the time each outgoing
message was handed over and when each late incoming message arrived, and where the worker ran
(host, device, the cores it may use). From them:

- :func:`job_seconds`: seconds per job kind, the simulator's ``durations``. On CPU workers a job's
  *CPU* time: workers that share cores run their jobs slower when more of them are busy than there
  are cores, and the replay of :mod:`launcher.schedule.cores` charges that from the CPU each job
  asks for; on GPUs its wall time less its waits;
- :func:`message_cpu_seconds`: on CPU workers, what moving one message (an activation, a gradient,
  a weight copy, a partial sum) costs the worker's communication threads (so a placement that moves
  more messages asks more of the cores);
- :func:`message_seconds`: what a message between workers really takes, the simulator's ``comm``:
  the median time from its hand-over at the sender to its arrival at a receiver that was waiting for
  it (activations, gradients, and the rounds of the all-reduces; one host's clock, so only when
  all workers share a host; ``None`` otherwise);
- :func:`end_seconds`: per worker, the end of the step (CPU on CPU workers, wall on GPUs);
- :func:`shared_cores`: how many cores the workers share, when they all run on one host's CPUs;
- :func:`outside_seconds`: per worker, a training step's time outside the engine (CPU on CPU
  workers, wall on GPUs).

Steps after the first count (the first one pays for warm-up), except an epoch's last, smaller batch
(a record marked ``short_batch``), unless every step is one.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any, Mapping, Sequence

Records = Sequence[Mapping[str, Any]]  # per worker: {"records": [record of each step, or {}]}


def _steps(r: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    recs = [x["measured_only"] for x in r["records"] if x]
    recs = [m for m in recs if not m.get("short_batch")] or recs  # an epoch's last, smaller batch
    return recs[1:] if len(recs) > 1 else recs


def on_cpu(per_rank: Records) -> bool:
    """True when the workers computed on CPUs (their job times are CPU times)."""
    return all(m.get("device", "cpu") == "cpu" for r in per_rank for m in _steps(r))


def job_seconds(per_rank: Records, kinds: Sequence[str]) -> dict[str, float]:
    """Mean seconds of each job kind over every worker and step after the first (see above): on
    CPU workers the compute thread's CPU (its communication threads' go per message,
    :func:`message_cpu_seconds`, or into the jobs when no message moved); on GPUs
    the wall time less the waits."""
    cpu = on_cpu(per_rank)
    extra = message_cpu_seconds(per_rank) is None  # nothing to charge them to but the jobs
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for r in per_rank:
        for m in _steps(r):
            for job in m["jobs"]:
                kind, work = job[2], job[3]
                if cpu and len(job) > 5:
                    work = job[4] if extra else job[5]
                total[kind] += work
                count[kind] += 1
    return {k: (total[k] / count[k] if count[k] else 0.0) for k in kinds}


def stage_job_seconds(per_rank: Records, kinds: Sequence[str], S: int) -> list[dict[str, float]]:
    """Per stage, :func:`job_seconds` of its own jobs: stages cut unevenly (a heavy head alone, or
    a partition by measured time) take their own time. A kind a stage never ran takes the mean
    over every stage."""
    cpu = on_cpu(per_rank)
    extra = message_cpu_seconds(per_rank) is None
    total: dict[tuple[int, str], float] = defaultdict(float)
    count: dict[tuple[int, str], int] = defaultdict(int)
    for r in per_rank:
        for m in _steps(r):
            for job in m["jobs"]:
                work = job[3]
                if cpu and len(job) > 5:
                    work = job[4] if extra else job[5]
                total[(int(job[0]), job[2])] += work
                count[(int(job[0]), job[2])] += 1
    mean = job_seconds(per_rank, kinds)
    return [{k: (total[(s, k)] / count[(s, k)] if count[(s, k)] else mean[k]) for k in kinds} for s in range(S)]


def message_cpu_seconds(per_rank: Records) -> float | None:
    """On CPU workers, the CPU seconds a worker's communication threads spent per message it moved
    during its jobs (what moving a message costs a core): activations and gradients sent or received,
    weight copies sent or received, partial gradient sums sent (their owners take them in at the end
    of the step, outside the jobs); ``None`` on GPUs or when no such message moved."""
    if not on_cpu(per_rank):
        return None
    other = messages = 0.0
    for r in per_rank:
        for m in _steps(r):
            other += sum(job[4] - job[5] for job in m["jobs"] if len(job) > 5)
            got, sent = m["recv_count"], m["sent_count"]
            messages += sum(got.get(k, 0) + sent.get(k, 0) for k in ("act", "grad", "weights")) + sent.get("wgrad", 0)
    return max(0.0, other) / messages if messages else None


def message_seconds(per_rank: Records) -> float | None:
    """Median seconds from a job input's hand-over to its arrival where the receiver waited for it
    (what a job waits after the one that made its input, on another worker)."""
    return _median_latency(per_rank, "arrivals")


def round_seconds(per_rank: Records, default: float) -> float:
    """Median seconds a round of the end-of-step exchange (a partial sum, an all-reduce's message)
    took where the receiver waited for it, from the later of its hand-over and its receive being
    posted (:class:`~launcher.runtime.comm.Clock`); ``default`` (what a message takes) where no
    round was waited for."""
    s = _median_latency(per_rank, "rounds")
    return default if s is None else s


def _median_latency(per_rank: Records, which: str) -> float | None:
    if len({m.get("host") for r in per_rank for m in _steps(r)}) != 1:
        return None
    by_step: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for r in per_rank:
        for k, m in enumerate(_steps(r)):
            by_step[k].append(m)
    samples = []
    for ms in by_step.values():
        sent = {mid: t for m in ms for mid, t in m.get("sent_at", {}).items()}
        # (key, arrival) or, for a round, (key, arrival, seconds since its receive was posted)
        samples += [min([t - sent[key], *posted]) for m in ms for key, t, *posted in m.get(which, ())
                    if key in sent and t >= sent[key]]
    # the median: a few messages that wait for a descheduled peer take ten times the rest
    return statistics.median(samples) if samples else None


def end_seconds(per_rank: Records) -> list[float]:
    """Per worker, the median seconds of the end of its steps (CPU on CPU workers, wall on GPUs)."""
    key = "end_cpu_s" if on_cpu(per_rank) else "end_s"
    return [statistics.median(m.get(key, 0.0) for m in _steps(r)) if _steps(r) else 0.0 for r in per_rank]


def shared_reduce(per_rank: Records) -> bool:
    """Whether the workers' replicas all-reduce through shared memory (:mod:`launcher.runtime.shared_reduce`)."""
    return any(m.get("shared_reduce", False) for r in per_rank for m in _steps(r)[:1])


def shared_cores(per_rank: Records) -> int | None:
    """The cores the workers share when they all compute on the CPUs of one host, else ``None``
    (a processor each: GPUs, or workers spread over hosts)."""
    ms = [m for r in per_rank for m in _steps(r)[:1]]
    if not ms or not on_cpu(per_rank) or len({m.get("host") for m in ms}) != 1:
        return None
    cores = {c for m in ms for c in m.get("cores", ())}
    return len(cores) or None


def outside_seconds(per_rank: Records) -> list[float]:
    """Per worker, the median seconds of a training step spent outside the engine (the framework's
    own work around it, the optimizer step): the step's CPU (``cpus``) less the engine's on CPU
    workers, its wall time (``walls``) less the engine's on GPUs. The last records go with the
    last steps (a resumed run's records start at the resume)."""
    cpu = on_cpu(per_rank)
    out = []
    for r in per_rank:
        engine = [x["measured_only"]["cpu_s" if cpu else "step_s"] if x else None for x in r["records"]]
        around = r.get("cpus" if cpu else "walls") or []
        gaps = [a - e for a, e in zip(reversed(around), reversed(engine)) if e is not None][::-1]
        gaps = gaps[1:] if len(gaps) > 1 else gaps
        out.append(max(0.0, statistics.median(gaps)) if gaps else 0.0)
    return out
