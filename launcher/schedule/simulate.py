"""The greedy list scheduler (docs/design.md, "The greedy simulator"), as a discrete-event simulation.

Repeatedly take, among the jobs whose predecessors are done, the one that can start soonest (its
worker free, its inputs finished, plus ``comm`` when an input crosses workers); ties on a worker
are broken by the order ``n``. Because every duration is positive, the soonest start never goes
back in time, so an ``argmin`` of start times over the frontier is the same as popping worker decision
points from a heap in time order. Each worker keeps a heap of jobs waiting for their inputs
(keyed by ready time) and heaps of jobs already available (keyed by ``n``), one per memory class,
so a step costs ``O(log)`` per job, not a scan of the frontier.

Memory (:mod:`launcher.schedule.activations`, the one memory model): a micro-batch's stage is one
unit of activations on the worker of ``F(s,b)`` from that job's start; its input's part is freed
at the end of the backward that consumes it (``B``, or ``I`` when split), its graph's part
(``graph_share``; all of it by default) at the end of ``W``. A per-worker ``memory_limit`` M keeps
a worker from starting a forward that would hold more than M units; the 1F1B warm-up keeps a
worker whose lowest stage is ``s`` to at most ``height(s)`` (``S - s`` on a chain) micro-batches
in flight (from ``F`` to ``I``). ``peak_activations`` counts live inputs (``x_s^b`` from ``F`` to
``B`` or ``I``), as the runtime's meter counts them; :func:`launcher.schedule.activations.unit_peaks`
gives the units a limit bounds.

Deferred weight gradients (``order=zb_h1``, split backward only): ready ``W`` jobs wait in their own
per-worker heap. A worker runs the oldest one first when more than its slack are waiting (slack
``height(0) - height(lowest stage)``, ``s`` on a chain: the last stage defers most, as in ZB-H1),
and flushes them once it has no ``F`` or ``I`` left; otherwise a ``W`` never runs (the hand-made
schedule's fixed order, which the paper's bubble rates are computed from).

Fixed sequences (``order=interleaved_1f1b`` with its default warm-up): the order's keys number each
worker's jobs 0, 1, ...; a worker starts only the next one and waits for it, as Megatron's and
PyTorch's hand-made schedules do.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from .graph import JobSpace
from .order import Order
from .placement import Placement
from .rules import StepError, value_error

#: the share of a stage's micro-batch activations that is its forward's graph, kept until ``W``
#: (:mod:`launcher.schedule.activations`): the whole unit, the strict count
GRAPH_SHARE = 1.0


class ScheduleError(ValueError):
    """A schedule that cannot run: bad placement, or a memory limit under which it cannot finish."""


@dataclass
class Schedule:
    """Everything that defines one step's schedule, as :meth:`launcher.schedule.settings.Settings.schedule`
    builds it from the step's settings."""

    space: JobSpace
    placement: Placement
    workers: int
    order: Order
    durations: dict[str, float]
    comm: float
    memory_limit: int | Sequence[int] | None
    name: str = "custom"
    #: per stage, its own time per job kind (measured stages differ: a vocabulary head is slow);
    #: a kind a stage leaves out takes ``durations``'s time
    stage_durations: Sequence[Mapping[str, float]] | None = None
    #: stages whose backward (``B``, or ``I`` when split) recomputes their forward first
    #: (activation checkpointing): each such job takes its stage's forward time more
    recompute: frozenset[int] = frozenset()
    #: stages with no trainable parameter (every one ``requires_grad=False``): no weight gradient
    #: leaves them, so no partial sum is sent to their owners and their replicas all-reduce nothing
    frozen: frozenset[int] = frozenset()
    #: per stage (or one for all), the share of a micro-batch's activation unit that is its forward's
    #: graph, freed at ``W``; the rest, its input, is freed at ``I`` (:mod:`launcher.schedule.activations`)
    graph_share: float | Sequence[float] = GRAPH_SHARE

    @property
    def S(self) -> int:
        return self.space.S

    def crossing(self, src: int, dst: int) -> float:
        """What a value adds to its job's finish on its way from worker ``src`` to worker ``dst``:
        ``comm`` between two workers, nothing on one (the simulator's own loops inline this rule)."""
        return self.comm if src != dst else 0.0

    def duration_table(self, durations: Mapping[str, float] | None = None) -> list[float]:
        """Every job's duration, indexed by ``kind * S + stage`` (a job ``j`` is at ``j // B``):
        ``durations`` per kind (default: the step's), with the step's per-stage times over them.

        A recomputed stage's backward (``B``, or ``I`` when split) takes its forward's time more
        (a replay of measured times, which include it already, uses a step without ``recompute``)."""
        base = self.durations if durations is None else durations
        per = self.stage_durations
        if per is not None and len(per) != self.S:
            raise ScheduleError(f"stage_durations has {len(per)} entries but the step has S={self.S} stages")
        table = [float(per[s].get(k, base[k]) if per is not None else base[k])
                 for k in self.space.kinds for s in range(self.S)]
        if self.recompute:
            bwd = self.space.kinds.index("I" if self.space.split_backward else "B") * self.S
            for s in self.recompute:
                table[bwd + s] += table[s]  # kind F is first: table[s] is F(s)'s time
        return table

    @property
    def microbatches(self) -> int:
        return self.space.microbatches


@dataclass
class Timeline:
    """The simulated step: when and where every job ran."""

    schedule: Schedule
    compute: list[int]  # w_compute of each job id
    owner: list[int]  # w_owner of each job id
    start: list[float]
    finish: list[float]
    sequences: list[list[int]]  # per worker, its job ids in the order it runs them
    peak_activations: list[int]

    @property
    def latency(self) -> float:
        return max(self.finish) if self.finish else 0.0


def place_all(sched: Schedule) -> tuple[list[int], list[int]]:
    """``(w_compute, w_owner)`` of every job, checked against the worker count."""
    space, place, W = sched.space, sched.placement, sched.workers
    compute: list[int] = []
    owner: list[int] = []
    # the named schemes ignore the direction: place each (s, b) once and repeat it for every kind
    kinds = space.kinds[:1] if getattr(place, "same_for_every_direction", False) else space.kinds
    for d in kinds:
        for s in range(space.S):
            for b in range(space.microbatches):
                ww, wc = place(s, b, d)
                compute.append(wc)
                owner.append(ww)
    if len(kinds) < space.K:
        compute *= space.K
        owner *= space.K
    bad = next((j for j in range(space.N) if not (0 <= compute[j] < W and 0 <= owner[j] < W)), None)
    if bad is not None:
        s, b, d = space.job(bad)
        raise ScheduleError(
            f"placement {sched.name} sends job ({s}, {b}, {d}) to workers (w_owner={owner[bad]}, "
            f"w_compute={compute[bad]}), but workers must lie in [0, {W}) with W={W}"
        )
    return compute, owner


def worker_limits(sched: Schedule, compute: list[int]) -> tuple[list[float], list[float]]:
    """Per-worker activation limit M and micro-batches-in-flight limit (the 1F1B warm-up)."""
    W, space = sched.workers, sched.space
    ml = sched.memory_limit
    if ml is None:
        act = [math.inf] * W
    elif isinstance(ml, int):
        act = [float(ml)] * W
    else:
        act = [float(x) for x in ml]
    mb = [math.inf] * W
    if sched.order.in_flight_limit:
        height = space.graph.height()
        lowest = [space.S] * W
        for s in range(space.S):
            for b in range(space.microbatches):
                w = compute[s * space.microbatches + b]
                if s < lowest[w]:
                    lowest[w] = s
        mb = [float(height[lo]) if lo < space.S else math.inf for lo in lowest]
    return act, mb


def deferral(sched: Schedule, compute: list[int]) -> tuple[list[int], list[int]]:
    """ZB-H1's per-worker slack (``W`` jobs a worker may keep waiting: ``height(0) - height(s)`` for
    its lowest stage ``s``) and each worker's count of ``F`` and ``I`` jobs."""
    space, W = sched.space, sched.workers
    SB = space.S * space.microbatches
    height = space.graph.height()
    top = max(height)
    lowest = [space.S] * W
    fi = [0] * W
    for j in range(2 * SB):
        w = compute[j]
        fi[w] += 1
        s = (j % SB) // space.microbatches
        if s < lowest[w]:
            lowest[w] = s
    return [top - height[lo] if lo < space.S else 0 for lo in lowest], fi


def check_memory_limit(sched: Schedule, compute: list[int], act_limit: list[float]) -> None:
    """Reject a limit below what one micro-batch needs on one worker: that step can never finish."""
    space = sched.space
    need: dict[tuple[int, int], int] = {}
    for s in range(space.S):
        for b in range(space.microbatches):
            key = (compute[s * space.microbatches + b], b)
            need[key] = need.get(key, 0) + 1
    for (w, b), n in sorted(need.items()):
        if n > act_limit[w]:
            raise ScheduleError(
                f"memory_limit={int(act_limit[w])} on worker {w} cannot finish the step: worker {w} "
                f"holds {n} stages of micro-batch {b}, so it needs at least {n} live activations "
                f"before that micro-batch's backward can start"
            )


def _check_times(sched: Schedule) -> None:
    """A Schedule built by hand skips make_schedule's checks: a time that is not finite would stall it."""
    space = sched.space
    bad = [e for e in (value_error(f"durations.{k}", sched.durations.get(k)) for k in space.kinds) if e]
    bad += [e for e in [value_error("comm", sched.comm)] if e]
    if bad:
        raise StepError(bad)


def _check_limits(sched: Schedule, compute: list[int], act_limit: list[float]) -> None:
    """A ``memory_limit`` list needs an entry per worker, and each worker's limit room for what one
    micro-batch holds there (:func:`check_memory_limit`)."""
    W = sched.workers
    if sched.memory_limit is not None:
        if not isinstance(sched.memory_limit, int) and len(act_limit) != W:
            raise ScheduleError(
                f"memory_limit has {len(act_limit)} entries but there are W={W} workers; give one int or one per worker"
            )
        check_memory_limit(sched, compute, act_limit)


def _checked_deferral(sched: Schedule, compute: list[int]) -> tuple[list[int], list[int]]:
    """:func:`deferral`, for an order that defers ``W`` jobs, which exist only when the backward is split."""
    if sched.space.K != 3:
        raise ScheduleError(
            f"order={sched.order.name} defers the weight-gradient jobs W, so it needs split_backward=true"
        )
    return deferral(sched, compute)


def _heap_keys(sched: Schedule, compute: list[int]) -> tuple[list, bool, bool]:
    """Every job's tie-break key, whether the job's ready time goes ahead of it (``by_ready``) and
    whether the keys are packed: built-in static orders give int keys, so the job id is folded in
    and a heap entry is one int."""
    keys = sched.order.placed_keys(sched.space, compute)
    by_ready = sched.order.by_ready_time
    packed = not by_ready and sched.order.integer_keys
    if packed:
        N = sched.space.N
        keys = [n * N + j for j, n in enumerate(keys)]
    return keys, by_ready, packed


def _check_stage_durations(sched: Schedule) -> None:
    """Each stage's own times must be valid too (the first bad one is reported)."""
    bad = [e for e in (value_error(f"stage_durations.{s}.{k}", v) for s, per in enumerate(sched.stage_durations or ())
                       for k, v in per.items()) if e]
    if bad:
        raise StepError(bad[:1])


def _predecessor_counts(space: JobSpace) -> list[int]:
    """Per job, how many jobs it waits on (:meth:`JobSpace.pred`, counted per stage): a forward on its
    input stages' forwards, a backward on its output stages' backwards (a loss stage's on its own
    forward), a weight gradient on its input gradient."""
    S, B, N = space.S, space.microbatches, space.N
    SB = S * B
    stage_preds, stage_succs, is_sink = space.stage_preds, space.stage_succs, space.is_sink
    npred = [0] * N
    for s in range(S):
        nf = len(stage_preds[s])
        nb = len(stage_succs[s]) + (1 if is_sink[s] else 0)
        npred[s * B : (s + 1) * B] = [nf] * B
        npred[SB + s * B : SB + (s + 1) * B] = [nb] * B
    if space.K == 3:
        npred[2 * SB :] = [1] * SB
    return npred


def _admission_need(space: JobSpace, compute: list[int], W: int) -> list[int]:
    """Per worker ``w`` and micro-batch ``b`` (index ``b * W + w``): the activations ``b`` holds on ``w``."""
    B = space.microbatches
    need = [0] * (B * W)
    for j in range(space.S * B):
        need[(j % B) * W + compute[j]] += 1
    return need


def _first_events(
    npred: list[int], compute: list[int], W: int
) -> tuple[list[list], list[float], list[tuple[float, int]]]:
    """The jobs without predecessors, pending on their workers at time 0: per worker its heap of
    ``(ready time, job)``, when it next decides (inf: nothing to do) and the heap of decision points."""
    pend: list[list] = [[] for _ in range(W)]
    wake = [math.inf] * W
    events: list[tuple[float, int]] = []
    for j in range(len(npred)):
        if npred[j] == 0:
            w = compute[j]
            pend[w].append((0.0, j))
    for w in range(W):
        if pend[w]:
            heapq.heapify(pend[w])
            wake[w] = 0.0
            events.append((0.0, w))
    heapq.heapify(events)
    return pend, wake, events


def _stalled(sched: Schedule, done: int, stuck: list[int], limited: bool) -> ScheduleError:
    """Why a step stopped after ``done`` jobs with work left on the ``stuck`` workers. With finite
    times and no limit every job starts eventually, so only memory can stall a step."""
    N = sched.space.N
    if not limited:
        return ScheduleError(
            f"the step cannot finish: after {done} of {N} jobs no job can start on workers {stuck}, "
            f"though no memory limit applies; the placement or order is inconsistent"
        )
    if sched.memory_limit is None:  # 1F1B's warm-up alone: its in-flight limit stranded the placement
        return ScheduleError(
            f"order={sched.order.name} with warmup=classic cannot finish the step: after {done} of {N} jobs, "
            f"workers {stuck} each wait for the warm-up's in-flight limit, held by micro-batches that "
            f"wait on one another across workers; use warmup=none or another order"
        )
    return ScheduleError(
        f"memory_limit={sched.memory_limit} (warmup={sched.order.warmup}) cannot finish the step: "
        f"after {done} of {N} jobs, workers {stuck} each wait for activation memory held by "
        f"micro-batches that wait on one another across workers; raise memory_limit"
    )


def simulate(sched: Schedule) -> Timeline:
    """Run the greedy list scheduler; raise :class:`ScheduleError` if the step cannot finish."""
    space = sched.space
    S, B, N, W = space.S, space.microbatches, space.N, sched.workers
    _check_times(sched)
    compute, owner = place_all(sched)
    act_limit, mb_limit = worker_limits(sched, compute)
    _check_limits(sched, compute, act_limit)
    limited = sched.memory_limit is not None or sched.order.in_flight_limit
    defer = sched.order.defer_w
    if defer:
        slack, fi_left = _checked_deferral(sched, compute)
        wq: list[list] = [[] for _ in range(W)]  # ready W jobs per worker, by key
    keys, by_ready, packed = _heap_keys(sched, compute)
    # an order that is a fixed sequence per worker (its keys 0, 1, ... there): a worker starts only
    # the next job of its sequence, and waits for it
    strict = sched.order.in_sequence and packed
    turn = [0] * W  # per worker, the key of its next job
    _check_stage_durations(sched)
    dur = sched.duration_table()  # by kind * S + stage
    comm = float(sched.comm)
    SB = S * B
    npred = _predecessor_counts(space)  # remaining predecessors

    # Admission control, per worker w and micro-batch b (key b * W + w): the forward that starts b
    # on w reserves every activation b will hold there (need), so a micro-batch once admitted
    # never waits for memory on that worker, and greedy admission cannot strand half-finished
    # micro-batches that block each other. ``held`` = live activations + reserved ones not yet
    # taken. Memory classes of ready jobs: 0 = takes no activation, 1 = forward of a micro-batch
    # already admitted here, 2 = forward that must admit its micro-batch first.
    need = _admission_need(space, compute, W) if limited else []
    mb_left = list(need)  # forwards of b on w whose stash is still live
    admitted = bytearray(len(need))
    C = 3 if limited else 1
    # what a stage's unit gives back at its backward's end (I, or B: all) and at its W's end
    from .activations import unit_releases

    at_i, at_w = unit_releases(sched) if limited else ([1.0] * S, [0.0] * S)
    frees_at_w = limited and any(at_w)

    ready_at = [0.0] * N
    start = [0.0] * N
    finish = [0.0] * N
    sequences: list[list[int]] = [[] for _ in range(W)]
    avail: list[list[list]] = [[[] for _ in range(C)] for _ in range(W)]  # (n, job) per class
    # (time, key, last forward of b here, units, inputs) given back to a worker by another one
    releases: list[list] = [[] for _ in range(W)]
    free_at = [0.0] * W
    live = [0] * W
    held = [0.0] * W
    live_mb = [0] * W
    peak = [0] * W
    pend, wake, events = _first_events(npred, compute, W)  # pend: (ready time, job) per worker

    heappush, heappop = heapq.heappush, heapq.heappop
    # succ(j) = [base + b for base in succ_base[j // B]]: the stage graph's edges, per (kind, stage)
    succ_base = [[k - (k % B) for k in space.succ(q * B)] for q in range(space.K * S)]
    done = 0
    while events:
        T, w = heappop(events)
        if T != wake[w]:
            continue  # superseded by an earlier decision point
        wake[w] = math.inf
        rel = releases[w]
        while rel and rel[0][0] <= T:
            _, key, last, units, inputs = heappop(rel)
            live[w] -= inputs
            held[w] -= units
            if last:
                live_mb[w] -= 1
                admitted[key] = 0
        pw = pend[w]
        aw = avail[w]
        while pw and pw[0][0] <= T:
            r, j = heappop(pw)
            entry = keys[j] if packed else ((r, keys[j], j) if by_ready else (keys[j], j))
            if defer and j >= 2 * SB:
                heappush(wq[w], entry)
                continue
            c = 0 if not limited or j >= SB else 2 - admitted[(j % B) * W + w]
            heappush(aw[c], entry)

        best = None
        bc = 0
        forced = False
        blocked = False  # a forward waits for memory here
        if defer and wq[w] and (len(wq[w]) > slack[w] or fi_left[w] == 0):
            best, forced = wq[w][0], True  # too many deferred, or nothing else will come: W now
        elif C == 1:
            if aw[0]:
                best = aw[0][0]
        else:
            a2 = aw[2]
            while a2:  # forwards whose micro-batch another forward admitted meanwhile (DAGs)
                j = a2[0] % N if packed else a2[0][-1]
                if not admitted[(j % B) * W + w]:
                    break
                heappush(aw[1], heappop(a2))
            for c in range(C):
                hc = aw[c]
                if hc and (best is None or hc[0] < best):
                    if c == 2:  # admit a micro-batch only if all it will hold here fits
                        j = hc[0] % N if packed else hc[0][-1]
                        if held[w] + need[(j % B) * W + w] > act_limit[w] + 1e-9 or live_mb[w] >= mb_limit[w]:
                            blocked = True
                            continue
                    best = hc[0]
                    bc = c
        if strict and best is not None and best // N != turn[w]:
            best = None  # the next job of the sequence is not ready: wait for it
        if best is None and blocked and defer and wq[w] and frees_at_w:
            best, forced = wq[w][0], True  # a forward waits for memory that a deferred W gives back
        if best is None:
            nxt = pw[0][0] if pw else math.inf
            if rel and rel[0][0] < nxt:
                nxt = rel[0][0]
            if nxt < math.inf:
                wake[w] = nxt
                heappush(events, (nxt, w))
            continue

        j = heappop(wq[w] if forced else aw[bc])
        j = j % N if packed else j[-1]
        if defer and j < 2 * SB:
            fi_left[w] -= 1
        if strict:
            turn[w] += 1
        fin = T + dur[j // B]
        start[j] = T
        finish[j] = fin
        free_at[w] = fin
        sequences[w].append(j)
        done += 1
        wake[w] = fin
        heappush(events, (fin, w))

        if bc:  # a forward takes an activation (an admission reserves all of b's here)
            live[w] += 1
            if live[w] > peak[w]:
                peak[w] = live[w]
            if bc == 2:
                key = (j % B) * W + w
                admitted[key] = 1
                held[w] += need[key]
                live_mb[w] += 1
        elif j // SB == 0:  # unlimited run: still count activations
            live[w] += 1
            if live[w] > peak[w]:
                peak[w] = live[w]
        elif j // SB == 1 or (frees_at_w and j // SB == 2):
            # the backward that consumes x_s^b frees it on F(s,b)'s worker (and the unit's input
            # part); a W frees the unit's graph part there
            jf = j % SB
            wf = compute[jf]
            key = (jf % B) * W + wf
            last = 0
            inputs = 1 if j < 2 * SB else 0
            units = at_i[jf // B] if inputs else at_w[jf // B]
            if limited and inputs:
                mb_left[key] -= 1
                last = 1 if mb_left[key] == 0 else 0
            if wf == w:  # nothing on w can start before fin anyway
                live[w] -= inputs
                held[w] -= units
                if last:
                    live_mb[w] -= 1
                    admitted[key] = 0
            else:
                heappush(releases[wf], (fin, key, last, units, inputs))
                # a busy holder sees the release when it is next free, not mid-job
                t = fin if fin > free_at[wf] else free_at[wf]
                if t < wake[wf]:
                    wake[wf] = t
                    heappush(events, (t, wf))

        b = j % B
        for k in succ_base[j // B]:
            k += b
            wk = compute[k]
            r = fin + comm if wk != w else fin
            if r > ready_at[k]:
                ready_at[k] = r
            npred[k] -= 1
            if npred[k] == 0:
                r = ready_at[k]
                heappush(pend[wk], (r, k))
                t = r if r > free_at[wk] else free_at[wk]
                if t < wake[wk]:
                    wake[wk] = t
                    heappush(events, (t, wk))

    if done != N:
        raise _stalled(sched, done, [w for w in range(W) if any(avail[w]) or pend[w]], limited)
    return Timeline(sched, compute, owner, start, finish, sequences, peak)
