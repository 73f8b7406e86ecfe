"""The one memory model of activations: live activation bytes per worker, swept exactly over a
simulated timeline. The run report's prediction (:mod:`launcher.report.metrics_json`), the
planner's memory model (:mod:`launcher.plan.memory`) and every activation limit (the simulator's
admission control, ``order=auto``'s search, named orders under ``memory_limit``, the planner's
budget in activations) count this way, and the runtime's meter measures it.

For each micro-batch ``b`` of stage ``s``, on the worker of ``F(s,b)``:

- its input ``x_s^b`` (``inputs[s][b]`` bytes) from the start of ``F(s,b)`` to the end of the
  backward that consumes it (``B``, or ``I`` when split);
- the forward's autograd graph (``saved[s][b]`` bytes): from the start of ``F(s,b)``, or, when
  the forward recomputes (activation checkpointing), from the start of that backward, which
  rebuilds it; to the end of ``B``, or of ``W`` when split (``I``'s graph is kept for ``W``).

A release at time t comes before an acquisition at t.

An activation limit (``memory_limit``, ``plan.max_activations``) counts the same bytes in units of
one stage's micro-batch (its input plus its graph): stage ``s`` holds ``1 - g_s`` of a unit (its
input) from ``F`` to ``I`` and ``g_s`` (its graph) from ``F`` to ``W``, where ``g_s``, the graph's
share (``graph_share``; per stage from a profile's bytes, :func:`graph_shares`), defaults to 1: a
transformer stage's graph is nearly all of it, and the whole unit until ``W`` is the strict count
(a schedule within a limit under it is within the limit under any smaller share).
:func:`unit_releases` is what the simulator's admission control and ``order=auto``'s
construction free at each job's end, and :func:`unit_peaks` the peak they keep under. Pure Python.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from .simulate import Schedule, Timeline

Bytes = Callable[[int, int], float]


def activation_peaks(tl: Timeline, inputs: Bytes, saved: Bytes | None = None,
                     recomputed: Sequence[bool] | None = None) -> list[float]:
    """Peak live activation bytes per worker. ``inputs(s, b)``, ``saved(s, b)``: bytes per
    micro-batch; ``recomputed[j]`` for each forward job id ``j = s * B + b`` (default: none)."""
    space = tl.schedule.space
    B, SB = space.microbatches, space.S * space.microbatches
    last = 2 * SB if space.split_backward else SB  # the job that frees the graph: W, else B
    events: list[list[tuple[float, int, float]]] = [[] for _ in range(tl.schedule.workers)]
    for j in range(SB):
        s, b = divmod(j, B)
        ev = events[tl.compute[j]]
        a = inputs(s, b)
        ev.append((tl.start[j], 1, a))
        ev.append((tl.finish[SB + j], 0, -a))  # B(s,b), or I(s,b) when split
        g = saved(s, b) if saved is not None else 0
        if g:
            rc = recomputed is not None and recomputed[j]
            ev.append((tl.start[SB + j] if rc else tl.start[j], 1, g))
            ev.append((tl.finish[last + j], 0, -g))
    return [_peak(ev) for ev in events]


def _peak(events: list[tuple[float, int, float]]) -> float:
    """The most bytes live at once: events ``(time, 1 acquire / 0 release, +-bytes)``, a release
    at time t before an acquisition at t."""
    live: float = 0
    peak: float = 0
    for _, _, n in sorted(events):
        live += n
        peak = max(peak, live)
    return peak


def graph_shares(sched: Schedule) -> list[float]:
    """Per stage, the share ``g_s`` of one micro-batch's activations that is its forward's graph,
    kept until ``W`` (``sched.graph_share``: one for every stage, or one per stage)."""
    g = sched.graph_share
    return [float(g)] * sched.S if isinstance(g, (int, float)) else [float(x) for x in g]


def unit_releases(sched: Schedule) -> tuple[list[float], list[float]]:
    """Per stage, the units of one micro-batch's activations freed at the end of its backward
    (``I``; ``B`` frees the whole unit) and at the end of its ``W``: the one rule the simulator's
    admission control and ``order=auto``'s construction free memory by."""
    if not sched.space.split_backward:
        return [1.0] * sched.S, [0.0] * sched.S
    g = graph_shares(sched)
    return [1.0 - x for x in g], g


def unit_peaks(tl: Timeline) -> list[float]:
    """Peak live activation units per worker (module docstring): :func:`activation_peaks` with
    each stage's input and graph in units, its recomputing stages' graphs rebuilt by the backward.
    What ``memory_limit`` bounds."""
    g = graph_shares(tl.schedule)
    space, rc = tl.schedule.space, tl.schedule.recompute
    recomputed = [j // space.microbatches in rc for j in range(space.S * space.microbatches)] if rc else None
    peaks = activation_peaks(tl, lambda s, b: 1.0 - g[s], lambda s, b: g[s], recomputed)
    return [round(p, 9) for p in peaks]


def recomputed_forwards(tl: Timeline, weight_cache: str) -> list[bool]:
    """Per forward job ``j = s * B + b``: whether it keeps only its input, its backward
    recomputing it: its stage is in ``sched.recompute``, or, under ``weight_cache="job"``, it runs
    on a fetched copy that it frees when it ends (the runtime's rule)."""
    space, rc = tl.schedule.space, tl.schedule.recompute
    B = space.microbatches
    return [j // B in rc or (weight_cache == "job" and tl.compute[j] != tl.owner[j])
            for j in range(space.S * B)]


@dataclass(frozen=True)
class SumHandover:
    """One worker's partial weight-gradient sum of a stage it computes on fetched weights, for
    one owner, under weight cache ``job``: live on ``sender`` from the start of its first gradient
    job of the stage for that owner (program index ``first``). When the stage has one owner, the
    owner takes the sum in after its job ``post`` (the first that starts once the sum is complete)
    and the sender waits for its delivery and frees it before its job ``deliver`` (the first that
    starts after ``post`` does). ``None``: at the end of the step (several owners, or no such job)."""

    stage: int
    sender: int
    owner: int
    first: int
    post: int | None
    deliver: int | None


def sum_handovers(tl: Timeline) -> list[SumHandover]:
    """Every partial sum a worker sends an owner, and when it is handed over
    (:class:`SumHandover`): the one rule the runtime lowers (:mod:`launcher.schedule.lowering`) and the
    memory model counts."""
    space, W = tl.schedule.space, tl.schedule.workers
    B, SB, S = space.microbatches, space.S * space.microbatches, space.S
    grad_kind = space.K - 1  # B, or W when split: the job that yields a weight gradient
    owners: list[set[int]] = [set() for _ in range(S)]
    for j in range(space.N):
        owners[(j // B) % S].add(tl.owner[j])
    starts = [[tl.start[j] for j in tl.sequences[w]] for w in range(W)]
    first: dict[tuple[int, int, int], int] = {}
    last: dict[tuple[int, int, int], int] = {}
    for w in range(W):
        for i, j in enumerate(tl.sequences[w]):
            if j // SB == grad_kind and tl.owner[j] != w and (j // B) % S not in tl.schedule.frozen:
                key = ((j // B) % S, w, tl.owner[j])
                first.setdefault(key, i)
                last[key] = j
    out = []
    for (s, w, o), j in sorted(last.items()):
        post = deliver = None
        if len(owners[s]) == 1:
            i = bisect_left(starts[o], tl.finish[j])
            if i < len(starts[o]):
                post = i
                k = bisect_right(starts[w], starts[o][i])
                deliver = k if k < len(starts[w]) else None
        out.append(SumHandover(s, w, o, first[(s, w, o)], post, deliver))
    return out


def gradient_peaks(tl: Timeline, grads: Callable[[int], float], cache: str = "job") -> list[float]:
    """Peak bytes of weight-gradient buffers beyond the owned stages' own, live at once on each
    worker (``grads(s)``: stage ``s``'s gradient bytes), swept over the timeline:

    - partial sums of fetched stages: under cache ``job`` from the first gradient job of the stage
      to their hand-over (:func:`sum_handovers`); under ``step`` kept all step (buffers reused
      from step to step);
    - an owner's receive buffers for the sums it takes in at a job, during that job (``job``);
    - each gradient job: the gradient autograd returns for the stage's weights, during the job,
      before it is added into the sum.
    """
    space, W = tl.schedule.space, tl.schedule.workers
    B, SB, S = space.microbatches, space.S * space.microbatches, space.S
    grad_kind = space.K - 1
    events: list[list[tuple[float, int, float]]] = [[] for _ in range(W)]

    def live(w: int, t0: float, t1: float, n: float) -> None:
        events[w].append((t0, 1, n))
        events[w].append((t1, 0, -n))

    for h in sum_handovers(tl):
        prog, g = tl.sequences[h.sender], grads(h.stage)
        if cache == "job":
            end = tl.start[prog[h.deliver]] if h.deliver is not None else tl.latency
            live(h.sender, tl.start[prog[h.first]], end, g)
            if h.post is not None:
                j = tl.sequences[h.owner][h.post]
                live(h.owner, tl.start[j], tl.finish[j], g)
        else:
            live(h.sender, 0.0, tl.latency, g)
    for w in range(W):
        for j in tl.sequences[w]:
            if j // SB == grad_kind:
                live(w, tl.start[j], tl.finish[j], grads((j // B) % S))
    return [_peak(ev) for ev in events]
