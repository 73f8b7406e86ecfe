"""Workers that share cores: how long a simulated step takes when its W workers run on C < W cores.

The simulator assumes every worker has a processor of its own (a GPU each, or a core each). When
W worker processes share C cores (a CPU machine with fewer cores than workers), a job runs slower
while more than C workers are busy at once. The runtime runs each worker's jobs in the order the
simulator chose (:attr:`Timeline.sequences`), so this replays those sequences, job by job, with
*processor sharing*: at any moment the ``n`` workers that have a job they can run each progress
at ``min(1, C / n)`` of a core. A job can run once the worker's previous job is done and its
inputs have arrived (``comm`` after the producing job when it ran elsewhere; given ``fetched``, a
job on a weight copy also waits ``comm`` after its owner hands the copy over). After its last job a
worker has ``tails[w]`` more seconds of work (the gradient exchange and the optimizer step), which
starts once the workers it exchanges with (``sync[w]``) have finished their jobs too and
``delays[w]`` seconds more have passed (the exchange's message rounds, which wait without
computing).

With ``cores >= W``, no tails and no ``fetched`` this is the simulated timeline itself (the same order, durations
and message delays), so ``replay(tl, W).seconds == tl.latency``, unless the simulator kept a worker
waiting for activation memory (a memory limit, 1F1B's warm-up): the runtime follows the order and
waits for nothing else, so the replay is then shorter. Pure Python; ``O(jobs x W)``, and without events
when every worker has a core.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, NamedTuple, Sequence

from .lowering import weight_messages
from .simulate import Timeline


class Replayed(NamedTuple):
    """The replayed step: its seconds; per worker the wall seconds it spent running jobs (at
    whatever share of a core it had), the counterpart of a measured worker's busy time; and when
    each job started and finished."""

    seconds: float
    busy: list[float]
    start: list[float]
    finish: list[float]

    def timeline(self, tl: Timeline) -> Timeline:
        """``tl`` with the replayed times (the same programs)."""
        return Timeline(tl.schedule, tl.compute, tl.owner, self.start, self.finish, tl.sequences, tl.peak_activations)


def replay(
    tl: Timeline,
    cores: int,
    tails: Sequence[float] | None = None,
    sync: Sequence[Sequence[int]] | None = None,
    delays: Sequence[float] | None = None,
    *,
    durations: Mapping[str, float] | Sequence[float] | None = None,
    comm: float | None = None,
    fetched: Mapping[int, int] | None = None,
) -> Replayed:
    """The step's makespan when its workers share ``cores`` cores (see the module docstring).

    ``durations`` (per job kind, or per job id) and ``comm`` (default: the step's) time the
    programs: the runtime runs the programs of the timeline it was given, whatever durations
    chose that order, so a measured run is replayed as it ran. ``fetched``: per job that receives
    weights before it, the owner's job after which they are handed over (``-1``: at the start of the
    step; :func:`~launcher.schedule.lowering.weight_arrivals`); the job waits for them a ``comm``
    after that. Without it weight copies wait for nothing (the simulator's timeline)."""
    step = tl.schedule
    W = step.workers
    d = step.durations if durations is None else durations
    work = job_work(tl, d) if isinstance(d, Mapping) else [float(x) for x in d]
    comm = float(step.comm if comm is None else comm)
    tails = list(tails) if tails is not None else [0.0] * W
    sync = [list(s) for s in sync] if sync is not None else [[] for _ in range(W)]
    delays = list(delays) if delays is not None else [0.0] * W
    fetched = fetched or {}
    if cores >= W:  # nobody shares a core: each job starts when its worker and its inputs are ready
        return _longest_paths(tl, work, comm, tails, sync, delays, fetched)
    return _processor_sharing(tl, cores, work, comm, tails, sync, delays, fetched)


def _processor_sharing(tl: Timeline, cores: int, work: list[float], comm: float, tails: list[float],
                       sync: Sequence[Sequence[int]], delays: list[float], fetched: Mapping[int, int]) -> Replayed:
    """:func:`replay` on fewer cores than workers: from event to event (a piece of work ends, or one
    can start), the workers with work in hand share the cores. One loop, written inline: it runs
    once per event, and the planner replays every candidate on a CPU profile."""
    W, programs = tl.schedule.workers, tl.sequences
    finish = [math.nan] * tl.schedule.space.N
    start = [math.nan] * tl.schedule.space.N
    pos = [0] * W  # next job of each worker (len(program): its tail)
    left: list[float | None] = [None] * W  # work left of what the worker runs now
    jobs_done = [0.0] * W  # when the worker's last job ended
    ended = [False] * W
    end = [0.0] * W
    busy = [0.0] * W
    ready_at = _readiness(tl, comm, sync, delays, pos, finish, jobs_done, fetched)
    t = 0.0
    while not all(ended):
        running: list[int] = []
        in_hand: list[float] = []  # left[w] of each running worker, in the same order
        wake = math.inf
        for w in range(W):
            if ended[w]:
                continue
            x = left[w]
            if x is None:
                r = ready_at(w)
                if r > t:
                    wake = min(wake, r)
                    continue
                x = left[w] = work[programs[w][pos[w]]] if pos[w] < len(programs[w]) else tails[w]
                if pos[w] < len(programs[w]):
                    start[programs[w][pos[w]]] = t
            running.append(w)
            in_hand.append(x)
        if not running:
            if wake == math.inf:  # cannot happen for a timeline the simulator produced
                raise ValueError("the programs wait on one another: not a simulated timeline")
            t = wake
            continue
        rate = min(1.0, cores / len(running))
        dt = min(min(in_hand) / rate, wake - t)
        t += dt
        for w, x in zip(running, in_hand):
            if pos[w] < len(programs[w]):
                busy[w] += dt
            x -= dt * rate
            left[w] = x
            if x <= 1e-12 * max(1.0, t):
                left[w] = None
                if pos[w] < len(programs[w]):
                    finish[programs[w][pos[w]]] = t
                    pos[w] += 1
                    if pos[w] == len(programs[w]):
                        jobs_done[w] = t
                else:
                    ended[w], end[w] = True, t
    return Replayed(max(end, default=0.0), busy, start, finish)


def _readiness(tl: Timeline, comm: float, sync: Sequence[Sequence[int]], delays: list[float], pos: list[int],
               finish: list[float], jobs_done: list[float], fetched: Mapping[int, int]) -> Callable[[int], float]:
    """``ready_at(w)``: when worker ``w``'s next piece of work can start (inf: it waits on something
    unfinished), read from the replay's state as it goes (``pos``, ``finish``, ``jobs_done``)."""
    space, programs, compute = tl.schedule.space, tl.sequences, tl.compute

    def ready_at(w: int) -> float:
        prog = programs[w]
        if pos[w] < len(prog):
            j = prog[pos[w]]
            r = 0.0
            for p in space.pred(j):
                if math.isnan(finish[p]):
                    return math.inf
                r = max(r, finish[p] + (comm if compute[p] != w else 0.0))
            if (q := fetched.get(j)) is not None:  # weights handed over after the owner's job q
                if q >= 0 and math.isnan(finish[q]):
                    return math.inf
                r = max(r, (finish[q] if q >= 0 else 0.0) + comm)
            return r
        r = jobs_done[w]
        for o in sync[w]:
            if pos[o] < len(programs[o]):
                return math.inf
            r = max(r, jobs_done[o])
        return r + delays[w]

    return ready_at


def _longest_paths(tl: Timeline, work: list[float], comm: float, tails: list[float],
                   sync: Sequence[Sequence[int]], delays: list[float], fetched: Mapping[int, int]) -> Replayed:
    """:func:`replay` with a core per worker, without events: each job starts at
    ``max(its worker's previous finish, its inputs' finish + comm)``; the same times as the
    processor-sharing loop at a rate of 1, without its events."""
    space, programs, compute = tl.schedule.space, tl.sequences, tl.compute
    W = len(programs)
    start, finish = [math.nan] * space.N, [math.nan] * space.N
    pos, free = [0] * W, [0.0] * W
    left = sum(map(len, programs))
    while left:
        moved = False
        for w, prog in enumerate(programs):
            while pos[w] < len(prog):  # as far as its inputs are known
                j = prog[pos[w]]
                r = free[w]
                for p in space.pred(j):
                    f = finish[p]
                    if f != f:  # NaN: not yet placed
                        break
                    r = max(r, f + (comm if compute[p] != w else 0.0))
                else:
                    if (q := fetched.get(j)) is not None:  # weights handed over after the owner's job q
                        if q >= 0 and finish[q] != finish[q]:
                            break
                        r = max(r, (finish[q] if q >= 0 else 0.0) + comm)
                    start[j], finish[j] = r, r + work[j]
                    free[w] = finish[j]
                    pos[w] += 1
                    left -= 1
                    moved = True
                    continue
                break
        if not moved:
            raise ValueError("the programs wait on one another: not a simulated timeline")
    end = [max([free[w], *(free[o] for o in sync[w])]) + delays[w] + tails[w] for w in range(W)]
    busy = [sum(work[j] for j in prog) for prog in programs]
    return Replayed(max(end, default=0.0), busy, start, finish)


def crossings(tl: Timeline) -> list[int]:
    """Per job, the messages it receives and sends: its dependencies on and for jobs of other
    workers (activations and gradients)."""
    space, compute = tl.schedule.space, tl.compute
    out = [0] * space.N
    for j in range(space.N):
        for p in space.pred(j):
            if compute[p] != compute[j]:
                out[j] += 1
                out[p] += 1
    return out


def job_work(tl: Timeline, durations: Mapping[str, float], message_s: float | None = None,
             weight_cache: str | None = None) -> list[float]:
    """Per job, its duration by kind plus ``message_s`` for each message its worker moves while it
    runs (on CPU workers the communication threads' share of a core): the activations and gradients
    it receives and sends (:func:`crossings`) and, given the ``weight_cache`` the step runs with, the
    weight copies and partial gradient sums (:func:`~launcher.schedule.lowering.weight_messages`)."""
    B = tl.schedule.space.microbatches
    # the step's own per-stage times apply to its own durations (a replay by other times is by kind)
    table = tl.schedule.duration_table(None if durations is tl.schedule.durations else durations)
    if not message_s:
        return [table[j // B] for j in range(tl.schedule.space.N)]
    moved = crossings(tl)
    work = [table[j // B] + message_s * moved[j] for j in range(tl.schedule.space.N)]
    return work if weight_cache is None else with_weight_messages(work, tl, weight_cache, message_s)


def with_weight_messages(work: Sequence[float], tl: Timeline, weight_cache: str, message_s: float) -> list[float]:
    """``work`` (per job) plus ``message_s`` for each weight copy and partial sum its worker moves
    at it under ``weight_cache`` (:func:`~launcher.schedule.lowering.weight_messages`)."""
    return [x + message_s * n for x, n in zip(work, weight_messages(tl, weight_cache))]
