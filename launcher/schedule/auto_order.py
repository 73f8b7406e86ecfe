"""``order=auto``: the schedule a search finds for the step's own profile under a memory limit.

Seed 004 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024), section 3: given ``T_F``,
``T_I``, ``T_W`` per stage, ``comm`` and a per-worker activation limit, find each worker's job
sequence, ``W`` jobs included, with the shortest step. Activations are counted as the paper counts
them: a micro-batch's stage holds one unit on its worker from the start of its ``F`` to the end of
its ``W`` (the ``I`` frees the input but the graph lives on for ``W``). The simulator's own
``memory_limit`` counts from ``F`` to ``I`` only, so the paper's count is the stricter one: a
sequence that meets it meets the simulator's.

The search (:func:`auto_sequences`) is a portfolio, each candidate run by the real simulator:

- a greedy event-driven construction on the step's dependency graph (any placement): a free worker
  runs a ready ``I`` first, then a ready ``F`` if its live units stay under its cap (so the warm-up
  takes as many ``F`` as memory allows), else a ready ``W`` (which fills gaps and frees memory);
  variants differ in the cap (the limit, one less: the paper's choice about one more warm-up ``F``,
  and 1F1B's per-stage warm-up scaled) and in whether a ``W`` may start when an ``I`` or ``F``
  becomes ready before it would end;
- the named orders' own schedules (1F1B on the split backward, ZB-H1, ZB-H2) under the same limit.

Each candidate runs as its sequences, without the simulator's admission control: the sequences
keep to the limit themselves, under the stricter count. The shortest one that meets the limit
wins (the first, on a tie: deterministic). Pure Python.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Sequence

from .order import AutoOrder, make_order

if TYPE_CHECKING:
    from .simulate import Step, Timeline


def worker_cap(step: Step) -> list[float]:
    """Each worker's activation limit (units of one stage's micro-batch); ``inf`` without a limit."""
    ml = step.memory_limit
    if ml is None:
        return [math.inf] * step.workers
    return [float(ml)] * step.workers if isinstance(ml, int) else [float(x) for x in ml]


def paper_peaks(tl: Timeline) -> list[int]:
    """Peak live units per worker counted from each ``F``'s start to its ``W``'s end (the paper's
    count; a release at time t before an acquisition at t)."""
    space = tl.step.space
    SB = space.S * space.B
    last = 2 * SB if space.split_backward else SB
    events: list[list[tuple[float, int]]] = [[] for _ in range(tl.step.workers)]
    for j in range(SB):
        ev = events[tl.compute[j]]
        ev.append((tl.start[j], 1))
        ev.append((tl.finish[last + j], -1))
    out = []
    for ev in events:
        live = peak = 0
        for _, n in sorted(ev):
            live += n
            peak = max(peak, live)
        out.append(peak)
    return out


def greedy(step: Step, compute: Sequence[int], caps: Sequence[float], fit_w: bool) -> list[list[int]]:
    """The greedy construction (module docstring): each worker's sequence. ``caps[w]``: the most
    live units (``F`` to ``W``) worker ``w`` keeps; ``fit_w``: a ``W`` starts only if no ``I`` or
    ``F`` it could run becomes ready before the ``W`` would end."""
    space = step.space
    N, B, SB, W = space.N, space.B, space.S * space.B, step.workers
    dur = step.duration_table()
    npred = [len(space.pred(j)) for j in range(N)]
    ready = [0.0] * N
    # per worker: released jobs by kind, each a heap of (ready time, micro-batch, job)
    rel: list[list[list[tuple[float, int, int]]]] = [[[], [], []] for _ in range(W)]
    free = [0.0] * W
    live = [0] * W
    seqs: list[list[int]] = [[] for _ in range(W)]
    for j in range(N):
        if npred[j] == 0:
            heapq.heappush(rel[compute[j]][j // SB], (0.0, j % B, j))

    def decide(w: int) -> tuple[float, int] | None:
        """When worker ``w`` starts its next job, and which."""
        t = free[w]
        f, i, wg = rel[w]
        f_ok = bool(f) and live[w] < caps[w]
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
        elif kind == 2 or (kind == 1 and space.K == 2):
            live[w] -= 1
        touched = {w}
        for k in space.succ(j):
            npred[k] -= 1
            r = end + (step.comm if compute[k] != w else 0.0)
            ready[k] = max(ready[k], r)
            if npred[k] == 0:
                v = compute[k]
                heapq.heappush(rel[v][k // SB], (ready[k], k % B, k))
                touched.add(v)
        for v in touched:
            redecide(v)
    return seqs


def _candidates(step: Step, compute: Sequence[int]) -> list[list[list[int]]]:
    """Every candidate's sequences: the greedy variants, then the named orders' schedules."""
    from .simulate import ScheduleError, simulate

    caps = worker_cap(step)
    space = step.space
    height = space.graph.height()
    lowest = [space.S] * step.workers
    for j in range(space.S * space.B):
        lowest[compute[j]] = min(lowest[compute[j]], j // space.B)
    warm = [height[lo] if lo < space.S else 1 for lo in lowest]  # 1F1B's warm-up per worker
    variants: list[list[float]] = []
    for c in (caps, [x - 1 for x in caps], [min(x, 2 * h) for x, h in zip(caps, warm)],
              [min(x, 2 * h - 1) for x, h in zip(caps, warm)], [min(x, h) for x, h in zip(caps, warm)]):
        if all(v >= 1 for v in c) and c not in variants:
            variants.append(c)
    out: list[list[list[int]]] = []
    for c in variants:
        for fit in (False, True):
            try:
                out.append(greedy(step, compute, c, fit))
            except ValueError:
                pass
    for name in ("zb_h1", "zb_h2", "1f1b"):
        try:
            out.append(simulate(replace(step, order=make_order(name))).program)
        except (ScheduleError, ValueError):  # ValueError: an order that does not fit the placement
            pass
    return out


def _key(step: Step) -> tuple:
    """Everything the search reads, hashable (its cache key)."""
    pl = step.placement
    sd = tuple(tuple(sorted(d.items())) for d in step.stage_durations) if step.stage_durations else None
    ml = step.memory_limit if step.memory_limit is None or isinstance(step.memory_limit, int) \
        else tuple(step.memory_limit)
    return (step.space.graph, step.space.B, step.space.split_backward, pl, step.workers,
            tuple(sorted(step.durations.items())), step.comm, ml, sd, step.recompute)


_CACHE: dict[tuple, tuple[tuple[int, ...], ...]] = {}


def auto_sequences(step: Step) -> tuple[tuple[int, ...], ...]:
    """The best sequences the search finds for ``step`` (module docstring): the shortest step,
    simulated strictly, whose activations (``F`` to ``W``) stay within the step's limit. Cached by
    profile."""
    from .simulate import ScheduleError, place_all, simulate

    if not step.space.split_backward:
        raise ValueError("order=auto schedules the split backward (F, I, W), so it needs split_backward=True")
    try:
        key: tuple | None = _key(step)
        hash(key)
    except TypeError:  # a user's placement callable that does not hash: no cache
        key = None
    if key is not None and key in _CACHE:
        return _CACHE[key]
    compute, _ = place_all(step)
    caps = worker_cap(step)
    best: tuple[float, tuple[tuple[int, ...], ...]] | None = None
    for seqs in _candidates(step, compute):
        frozen = tuple(tuple(s) for s in seqs)
        try:
            tl = simulate(replace(step, order=AutoOrder(warmup="classic", seqs=frozen), memory_limit=None))
        except ScheduleError:
            continue
        if any(p > c for p, c in zip(paper_peaks(tl), caps)):
            continue
        if best is None or tl.latency < best[0] - 1e-9:
            best = (tl.latency, frozen)
    if best is None:
        raise ScheduleError(f"order=auto found no schedule within memory_limit={step.memory_limit}: raise memory_limit")
    if key is not None:
        _CACHE[key] = best[1]
    return best[1]


