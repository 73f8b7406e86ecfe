"""``order=auto``: the schedule a search finds for the step's own profile under a memory limit.

Seed 004 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024), section 3: given ``T_F``,
``T_I``, ``T_W`` per stage, ``comm`` and a per-worker activation limit, find each worker's job
sequence, ``W`` jobs included, with the shortest step. Activations are counted by the one memory
model (:mod:`launcher.schedule.activations`), as the simulator's admission control and the planner
count them: a stage's micro-batch is one unit, taken at its ``F``'s start; the ``I`` frees its input
(``1 - graph_share`` of it), the ``W`` its graph (``graph_share``: all of it by default, this
runtime's strict count; the paper's ``M_W / M_B``, its Table 1, gives the paper's count).

The search (:func:`auto_sequences`) is a portfolio, each candidate run by the real simulator:

- a greedy event-driven construction on the step's dependency graph (any placement): a free worker
  runs a ready ``I`` first, then a ready ``F`` if its live units stay under its cap and its
  micro-batches between ``F`` and ``I`` under its warm-up depth, else a ready ``W`` (which fills
  gaps and frees memory). Variants differ in the cap (the limit, one less, and 1F1B's per-stage
  warm-up scaled), in the depth (the round trip's, :func:`round_trips`: as many ``F`` as fit before
  the worker's first ``I`` can come back, the paper's Appendix B; for the paper's objective also a
  grid of slopes over the stage's height) and in whether a ``W`` may start when an ``I`` or ``F``
  becomes ready before it would end;
- the named orders' own schedules (1F1B on the split backward, ZB-H1, ZB-H2) under the same limit.

Each candidate runs as its sequences, without the simulator's admission control: the sequences
keep to the limit themselves. The shortest one that meets the limit wins (the first, on a tie:
deterministic). Shortest means the makespan by default, what this runtime pays; the paper's own
cost, the longest worker's span (:func:`span`), is the other objective, for comparing with its
Table 5, and then the winner is polished by exchanging a ``W`` with an ``I`` that waited for it
(:func:`_polish`). Pure Python.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Sequence

from .activations import unit_peaks, unit_releases
from .order import AutoOrder, make_order

if TYPE_CHECKING:
    from .simulate import Schedule, Timeline

#: each worker's job sequence
Seqs = tuple[tuple[int, ...], ...]


def run_sequences(sched: Schedule, seqs: Seqs) -> Timeline:
    """``step`` simulated with each worker running ``seqs`` strictly, without the simulator's
    admission control (the sequences keep to the limit themselves)."""
    from .simulate import simulate

    return simulate(replace(sched, order=AutoOrder(warmup="classic", seqs=seqs), memory_limit=None))


def worker_cap(sched: Schedule) -> list[float]:
    """Each worker's activation limit (units of one stage's micro-batch); ``inf`` without a limit."""
    ml = sched.memory_limit
    if ml is None:
        return [math.inf] * sched.workers
    return [float(ml)] * sched.workers if isinstance(ml, int) else [float(x) for x in ml]


def _topological(preds: list[list[tuple[int, float]]]) -> list[int]:
    """The jobs in an order that puts every job after its predecessors (Kahn's)."""
    left = [len(p) for p in preds]
    succs: list[list[int]] = [[] for _ in preds]
    for j, ps in enumerate(preds):
        for k, _ in ps:
            succs[k].append(j)
    out = [j for j in range(len(preds)) if not left[j]]
    for j in out:  # grows while it is read
        for k in succs[j]:
            left[k] -= 1
            if not left[k]:
                out.append(k)
    return out


def span(tl: Timeline, above: float = math.inf) -> float:
    """The paper's cost of a step (its Appendix G, formula 3): the least ``C`` for which start times
    exist that keep every worker's order, every dependency (``comm`` between workers) and every
    worker's first job start to last job end within ``C``. It is what a step costs when consecutive
    steps overlap (no synchronisation at the optimizer step); this runtime pays ``tl.latency``.

    Each worker's longest chain from its first job to its last bounds ``C``; start times for that
    bound exist unless a cycle through several workers' spans is longer, which the relaxation below
    checks (then ``C`` is bisected up to the makespan, which always fits). A chain is never longer
    than the worker's span in ``tl`` (every job there starts as early as it can), so workers whose
    span cannot raise the bound are skipped; once the bound passes ``above`` it is returned as it
    is (a cost that loses to ``above`` need not be exact)."""
    sched, N = tl.schedule, len(tl.start)
    dur = [f - s for s, f in zip(tl.start, tl.finish)]
    preds: list[list[tuple[int, float]]] = [[] for _ in range(N)]
    for j in range(N):
        for k in sched.space.pred(j):
            preds[j].append((k, dur[k] + sched.crossing(tl.compute[k], tl.compute[j])))
    ends = []
    for prog in tl.sequences:
        for a, b in zip(prog, prog[1:]):
            preds[b].append((a, dur[a]))
        if prog:
            ends.append((prog[0], prog[-1]))
    topo = _topological(preds)
    pos = [0] * N
    for i, j in enumerate(topo):
        pos[j] = i
    bound = 0.0
    low = -math.inf
    for a, z in sorted(ends, key=lambda e: tl.start[e[0]] - tl.finish[e[1]]):  # the longest spans first
        if tl.finish[z] - tl.start[a] <= bound:
            break
        dist = [low] * N  # longest chain from a: a pass over the jobs between a and z
        dist[a] = 0.0
        for j in topo[pos[a] + 1:pos[z] + 1]:
            v = low
            for k, w in preds[j]:
                if dist[k] + w > v:
                    v = dist[k] + w
            dist[j] = v
        bound = max(bound, dist[z] + dur[z])
        if bound > above:
            return bound

    def fits(C: float) -> bool:  # Bellman-Ford from the ASAP times, a worker's span edge per round
        t = list(tl.start)
        for _ in range(len(ends) + 2):
            changed = False
            for a, z in ends:
                if t[a] < t[z] + dur[z] - C - 1e-9:
                    t[a], changed = t[z] + dur[z] - C, True
            for j in topo:
                v = max((t[k] + w for k, w in preds[j]), default=t[j])
                if v > t[j] + 1e-9:
                    t[j], changed = v, True
            if not changed:
                return True
        return False

    if fits(bound):
        return bound
    lo, hi = bound, tl.latency
    while hi - lo > 1e-9 * max(1.0, hi):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def greedy(sched: Schedule, compute: Sequence[int], caps: Sequence[float], fit_w: bool,
           depth: Sequence[float] | None = None) -> list[list[int]]:
    """The greedy construction (module docstring): each worker's sequence. ``caps[w]``: the most
    live units worker ``w`` keeps (:func:`launcher.schedule.activations.unit_peaks`' count);
    ``fit_w``: a ``W`` starts only if no ``I`` or ``F`` it could run becomes ready before the ``W``
    would end; ``depth[w]``: the most micro-batches worker ``w`` keeps between an ``F`` and its ``I``
    (its warm-up depth; ``None``: only memory bounds it)."""
    space = sched.space
    N, B, SB, W = space.N, space.microbatches, space.S * space.microbatches, sched.workers
    dur = sched.duration_table()
    at_i, at_w = unit_releases(sched)
    npred = [len(space.pred(j)) for j in range(N)]
    ready = [0.0] * N
    # per worker: released jobs by kind, each a heap of (ready time, micro-batch, job)
    rel: list[list[list[tuple[float, int, int]]]] = [[[], [], []] for _ in range(W)]
    free = [0.0] * W
    live = [0.0] * W
    inflight = [0] * W  # F started, its I (B) not yet
    most = list(depth) if depth is not None else [math.inf] * W
    seqs: list[list[int]] = [[] for _ in range(W)]
    for j in range(N):
        if npred[j] == 0:
            heapq.heappush(rel[compute[j]][j // SB], (0.0, j % B, j))

    def decide(w: int) -> tuple[float, int] | None:
        """When worker ``w`` starts its next job, and which."""
        t = free[w]
        f, i, wg = rel[w]
        f_ok = bool(f) and live[w] + 1 <= caps[w] + 1e-9 and inflight[w] < most[w]
        while True:
            ri = [x for x in i if x[0] <= t]
            if ri:
                return t, min(ri)[2]
            if f_ok:
                rf = [x for x in f if x[0] <= t]
                if rf:
                    return t, min(rf, key=lambda x: (x[1], x[2]))[2]
            rw = [x for x in wg if x[0] <= t]
            nxt = min([x[0] for x in i] + ([x[0] for x in f] if f_ok else []), default=math.inf)
            if rw:
                jw = min(rw, key=lambda x: (x[1], x[2]))[2]
                if not fit_w or nxt >= t + dur[jw // B] or nxt == math.inf:
                    return t, jw
            later = min([x[0] for x in i if x[0] > t] + [x[0] for x in wg if x[0] > t]
                        + ([x[0] for x in f if x[0] > t] if f_ok else []), default=math.inf)
            if later == math.inf:
                if rw:
                    return t, min(rw, key=lambda x: (x[1], x[2]))[2]
                return None
            t = later

    # each worker's next decision, in a heap of (start, worker, job, version): a worker's decision is
    # redone when its released jobs change, and the older entries are skipped by their version
    version = [0] * W
    pending: list[tuple[float, int, int, int]] = []

    def redecide(w: int) -> None:
        version[w] += 1
        d = decide(w)
        if d is not None:
            heapq.heappush(pending, (d[0], w, d[1], version[w]))

    for w in range(W):
        redecide(w)
    done = 0
    while done < N:
        while pending and pending[0][3] != version[pending[0][1]]:
            heapq.heappop(pending)
        if not pending:
            raise ValueError("order=auto: the greedy construction stalled (memory limit too small for the placement)")
        t, w, j, _ = heapq.heappop(pending)
        version[w] += 1  # taken: the worker decides again below
        kind = j // SB
        heap = rel[w][kind]
        heap.remove(next(x for x in heap if x[2] == j))
        heapq.heapify(heap)
        end = t + dur[j // B]
        free[w] = end
        seqs[w].append(j)
        done += 1
        if kind == 0:
            live[w] += 1
            inflight[w] += 1
        elif kind == 1:
            live[w] -= at_i[(j // B) % space.S]
            inflight[w] -= 1
        else:
            live[w] -= at_w[(j // B) % space.S]
        touched = {w}
        for k in space.succ(j):
            npred[k] -= 1
            r = end + sched.crossing(w, compute[k])
            ready[k] = max(ready[k], r)
            if npred[k] == 0:
                v = compute[k]
                heapq.heappush(rel[v][k // SB], (ready[k], k % B, k))
                touched.add(v)
        for v in touched:
            redecide(v)
    return seqs


#: the warm-up depths tried per worker besides the round trip's, for the paper's objective only (they
#: find spans a little shorter, at three times the search's cost): ``ceil(a (h - 1) + c)`` micro-batches
#: for the height ``h`` of its lowest stage (1F1B's warm-up is ``a = 1, c = 1``), each within its memory
DEPTH_SLOPES = tuple(x / 5 for x in range(5, 16))
DEPTH_OFFSETS = (0, 1)


def lowest_stages(sched: Schedule, compute: Sequence[int]) -> list[int]:
    """Each worker's lowest stage (``S`` for a worker that holds none)."""
    B = sched.space.microbatches
    lowest = [sched.space.S] * sched.workers
    for j in range(sched.space.S * B):
        lowest[compute[j]] = min(lowest[compute[j]], j // B)
    return lowest


def round_trips(sched: Schedule, compute: Sequence[int]) -> list[float]:
    """Per worker, how many of its lowest stage's ``F`` fit in the time from that stage's first ``F``
    starting to its first ``I`` being ready, with nothing else running (``comm`` between workers):
    the warm-up that keeps the worker busy until its first gradient comes back."""
    space, SB, B = sched.space, sched.space.S * sched.space.microbatches, sched.space.microbatches
    dur = sched.duration_table()
    start: dict[int, float] = {}
    # micro-batch 0's jobs depend only on each other: its forwards up the stages (numbered in a
    # topological order), then its input gradients back down
    for j in [s * B for s in range(space.S)] + [SB + s * B for s in reversed(range(space.S))]:
        start[j] = max((start[k] + dur[k // B] + sched.crossing(compute[k], compute[j]) for k in space.pred(j)),
                       default=0.0)
    out = []
    for lo in lowest_stages(sched, compute):
        if lo == space.S:
            out.append(1.0)
            continue
        f, i = lo * B, SB + lo * B
        out.append((start[i] - start[f]) / max(dur[lo], 1e-12))
    return out


def _binds(depth: Sequence[int], caps: Sequence[float]) -> bool:
    """Whether a warm-up depth changes anything under these caps: a worker's micro-batches between
    ``F`` and ``I`` are never more than its live units, so a depth of at least its cap never binds
    (and the greedy would repeat the capped variant)."""
    return any(d < math.floor(c) for d, c in zip(depth, caps))


def _candidates(sched: Schedule, compute: Sequence[int], grid: bool) -> list[list[list[int]]]:
    """Every candidate's sequences: the greedy variants, then the named orders' schedules."""
    from .simulate import ScheduleError, simulate

    caps = worker_cap(sched)
    space = sched.space
    height = space.graph.height()
    lowest = lowest_stages(sched, compute)
    warm = [height[lo] if lo < space.S else 1 for lo in lowest]  # 1F1B's warm-up per worker
    variants: list[tuple[list[float], list[int] | None]] = []
    for c in (caps, [x - 1 for x in caps], [min(x, 2 * h) for x, h in zip(caps, warm)],
              [min(x, 2 * h - 1) for x, h in zip(caps, warm)], [min(x, h) for x, h in zip(caps, warm)]):
        if all(v >= 1 for v in c) and (c, None) not in variants:
            variants.append((c, None))
    if sched.memory_limit is not None:  # under a limit, how deep each worker's warm-up goes decides the step
        # the round trip's depth, whole: a worker that starts one more F delays its first I, and with it
        # every worker upstream; the first workers have none upstream and fill their wait instead
        trips = round_trips(sched, compute)
        first = [space.graph.preds[lo] == () if lo < space.S else False for lo in lowest]
        for off in (0, -1, 1):
            depth = [max(1, min(math.floor(c), math.ceil(x - 1e-9) if top else math.floor(x + 1e-9) + off))
                     for c, x, top in zip(caps, trips, first)]
            if _binds(depth, caps) and (caps, depth) not in variants:
                variants.append((caps, depth))
        for a in DEPTH_SLOPES if grid else ():
            for off in DEPTH_OFFSETS:
                depth = [max(1, min(math.floor(c), math.ceil(a * (h - 1) + off - 1e-9)))
                         for c, h in zip(caps, warm)]
                if _binds(depth, caps) and (caps, depth) not in variants:
                    variants.append((caps, depth))
    out: list[list[list[int]]] = []
    for c, d in variants:
        for fit in (False, True):
            try:
                out.append(greedy(sched, compute, c, fit, d))
            except ValueError:
                pass
    for name in ("zb_h1", "zb_h2", "1f1b"):
        try:
            out.append(simulate(replace(sched, order=make_order(name))).sequences)
        except (ScheduleError, ValueError):  # ValueError: an order that does not fit the placement
            pass
    return out


def _key(sched: Schedule) -> tuple:
    """Everything the search reads, hashable (its cache key)."""
    pl = sched.placement
    sd = tuple(tuple(sorted(d.items())) for d in sched.stage_durations) if sched.stage_durations else None
    ml = sched.memory_limit if sched.memory_limit is None or isinstance(sched.memory_limit, int) \
        else tuple(sched.memory_limit)
    g = sched.graph_share if isinstance(sched.graph_share, (int, float)) else tuple(sched.graph_share)
    return (sched.space.graph, sched.space.microbatches, sched.space.split_backward, pl, sched.workers,
            tuple(sorted(sched.durations.items())), sched.comm, ml, sd, sched.recompute, g)


#: searched sequences by profile, the most recently used kept: the planner asks for a few dozen
#: profiles, and a long sweep in one process must not grow it without bound
_CACHE: OrderedDict[tuple, Seqs] = OrderedDict()
_CACHE_SIZE = 128

#: what the search minimises: the step's makespan, what this runtime pays (its optimizer step waits
#: for every worker), or the paper's cost, the longest worker's span (:func:`span`)
OBJECTIVES = ("makespan", "span")


def auto_sequences(sched: Schedule, objective: str = "makespan") -> Seqs:
    """The best sequences the search finds for ``sched`` (module docstring): the shortest step,
    simulated strictly, whose activations stay within the step's limit (the one memory model's
    units, :func:`launcher.schedule.activations.unit_peaks`); shortest by ``objective``
    (:data:`OBJECTIVES`). Cached by profile."""
    from .simulate import ScheduleError, place_all

    if not sched.space.split_backward:
        raise ValueError("order=auto schedules the split backward (F, I, W), so it needs split_backward=True")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r} is invalid: it must be one of {', '.join(OBJECTIVES)}")
    try:
        key: tuple | None = (*_key(sched), objective)
        hash(key)
    except TypeError:  # a user's placement callable that does not hash: no cache
        key = None
    if key is not None and key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    compute, _ = place_all(sched)
    caps = worker_cap(sched)

    def cost(seqs: Seqs, above: float = math.inf) -> tuple[float, Timeline] | None:
        """The step's cost under ``objective`` with these sequences (exact up to ``above``); ``None``
        past the limit."""
        try:
            tl = run_sequences(sched, seqs)
        except ScheduleError:
            return None
        if any(p > c + 1e-9 for p, c in zip(unit_peaks(tl), caps)):
            return None
        return (tl.latency if objective == "makespan" else span(tl, above)), tl

    best: tuple[float, Timeline, Seqs] | None = None
    for seqs in _candidates(sched, compute, grid=objective == "span"):
        frozen = tuple(tuple(s) for s in seqs)
        c = cost(frozen, best[0] if best else math.inf)
        if c is not None and (best is None or c[0] < best[0] - 1e-9):
            best = (c[0], c[1], frozen)
    if best is None:
        limit = sched.memory_limit
        raise ScheduleError(f"order=auto found no schedule within memory_limit={limit}: raise memory_limit")
    # the exchanges shorten a worker's span; the makespan of the candidates above they left as it was
    out = _polish(best[0], best[1], best[2], cost) if objective == "span" else best[2]
    if key is not None:
        _CACHE[key] = out
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return out


#: the most ``W``/``I`` exchanges :func:`_polish` tries for one step
POLISH_TRIES = 100


def _polish(value: float, tl: Timeline, seqs: Seqs,
            cost: Callable[[Seqs, float], tuple[float, Timeline] | None]) -> Seqs:
    """Exchange a ``W`` with the ``I`` right after it that had to wait for it, while the step gets
    shorter: a greedy worker starts a ``W`` when its next ``I`` is not yet ready, and that ``I``
    (and every worker upstream on its gradient's way) then waits out the ``W``'s rest. The latest
    such pairs are tried first (the ones at the end of a step decide its span); each kept exchange
    shortens the step, so this ends, and at most :data:`POLISH_TRIES` are simulated."""
    sched, space = tl.schedule, tl.schedule.space
    SB = space.S * space.microbatches
    tries = 0
    while True:
        pairs = []  # (the I's start, worker, position of the W)
        for w, seq in enumerate(seqs):
            for n in range(len(seq) - 1):
                a, b = seq[n], seq[n + 1]
                if a // SB != 2 or b // SB != 1:
                    continue
                ready = max((tl.finish[k] + sched.crossing(tl.compute[k], w) for k in space.pred(b)), default=0.0)
                if ready < tl.finish[a] - 1e-9:  # the I waited for this W
                    pairs.append((tl.start[b], w, n))
        for _, w, n in sorted(pairs, reverse=True):
            if tries >= POLISH_TRIES:
                return seqs
            tries += 1
            seq = seqs[w]
            swapped = seqs[:w] + ((*seq[:n], seq[n + 1], seq[n], *seq[n + 2:]),) + seqs[w + 1:]
            c = cost(swapped, value)
            if c is not None and c[0] < value - 1e-9:
                value, tl, seqs = c[0], c[1], swapped
                break
        else:
            return seqs
