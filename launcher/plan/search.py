"""Search the schedule space for the fastest step that fits a per-worker budget.

The search simulates one step per ``(G, R)`` (and the V shape, a placement of its own), order,
split and memory limit, best lower bound first, and evaluates every scheme, FSLPP ownership and
weight cache that computes there (see :mod:`launcher.plan.space`). Candidates are ranked by
predicted step time (per micro-batch, when several micro-batch counts are tried: the same profile
per micro-batch, more of them per step),
then traffic, then peak memory. Settings that lead to the same schedule (orders or memory limits
that give every worker the same jobs in the same order, which is all the runtime follows; a
weight cache on a scheme that fetches no weights) are one candidate, listed once under its
plainest settings. Pruning only skips what provably cannot enter
the top ``top``:

- **time bound**: a step lasts at least ``max(work, chain)``, where ``work`` is the busiest
  worker's total job time (``h(s, b)`` puts ``ceil(S/R) ceil(B/G)`` jobs of each kind on worker 0,
  the most of any) and ``chain`` is one micro-batch's dependency path
  (``S F + S B``, or ``S F + S I + W`` split, plus ``2 (S - 1) comm`` when ``R > 1``; on the V
  shape worker ``w`` runs stages ``w`` and ``S - 1 - w`` of every micro-batch and the chain crosses
  workers ``2 (S - 2)`` times, the V's turn staying on one worker). It holds for any order on
  that placement, sequenced ones (ZB-H2, ZB-V, auto) included. A
  simulation whose bound (per micro-batch) exceeds the ``top``-th best found so far is skipped:
  its every scheme, ownership and cache lasts at least that long (the gradient exchange a
  profile's link adds comes after the compute), so none can rank above it. Steps are
  simulated in increasing order of the bound, so good candidates come early and prune the rest.
- **memory bound**: a worker holds at least the ``ceil(S/R)`` activations of one micro-batch's
  stages at once (all its forwards run before any of its backwards), and its owned and fetched
  weights are known from the placement alone (cache ``step`` exactly; cache ``job`` holds at least
  one copy when it fetches at all). A scheme whose bound exceeds the budget is never evaluated,
  and a simulation none of whose schemes can fit is skipped.
- **the activation limit** ``memory_limit = M`` (the budget in activations, or per worker the
  activations that fit beside the weights) guarantees peak activation units ``<= M``: the simulator
  admits a micro-batch on a worker only when everything it will hold there fits. Activations are
  counted by the one memory model (:mod:`launcher.schedule.activations`): a stage's micro-batch is a
  unit, its input freed at ``I`` and its graph at ``W``, split by the profile's ``activation`` and
  ``saved`` bytes (:func:`graph_shares`); a byte budget's limit counts a unit as both.
- **a step that reaches its bound** ``max(work, chain)`` under some limit cannot be beaten by
  another limit of the same step, so the remaining limits are skipped.
- **cache job after cache step**: with a core per worker, cache ``job`` adds a forward to
  backwards on fetched weights of the same programs, which delays no job, so it is never faster
  than cache ``step``; it is then timed only when cache ``step`` would enter the top, and its
  memory is known only when it could. (Workers sharing fewer cores get no such shortcut: there
  more work can shorten the replay, so cache ``job`` is always timed.)

Memory limits tried per step: none, the activation budget, each scheme's byte-derived limit, and,
when the unlimited step does not fit, every uniform limit from the least that can finish upward
(the greedy scheduler is not monotone in the limit, and the admission control reserves a
micro-batch's activations ahead, so a limit above the budget can keep the peak inside it). The
upward scan stops at the first limit above those tried first whose step fits nowhere: a heuristic
(the peak rarely falls again as the limit grows), the one part of the search that is not exhaustive
over uniform limits. The brute force of ``tests/plan/test_planner.py`` tries every uniform limit.

``order=auto`` (:mod:`launcher.schedule.auto_order`) searches each worker's sequence for a step, so
each of its steps costs that search (about a second at 16 stages and 32 micro-batches) where a
named order costs one simulation. It is therefore tried after the named orders, and only at the
placements (``B``, ``G``, ``R``, the V shape apart) of the ``auto_top`` best candidates they found,
under the limits tried first there and those the listed candidates there use (its sequences keep
to a limit themselves, counted as the simulator counts them, so no upward scan). That
restriction is a heuristic: auto may beat the named orders at a placement none of whose named
candidates ranked high. It only adds candidates, so the best is never slower than the named
orders' best.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from ..schedule import ScheduleError, make_schedule, simulate
from ..schedule.activations import unit_peaks
from ..schedule.copies import ring_copies
from ..schedule.cores import job_work, replay, with_weight_messages
from ..schedule.link import end_of_step, exchanges
from ..schedule.link import step_time as link_step_time
from ..schedule.lowering import weight_arrivals
from ..schedule.metrics import _job_cache, traffic  # _job_cache: the cache "job" counts of per_worker
from ..schedule.overlap import steady_state
from ..schedule.schemes import named
from ..schedule.settings import DEFAULT
from ..schedule.simulate import GRAPH_SHARE, Timeline, place_all
from . import memory
from .partition import PARTITIONS, PartitionError, cut, group_sums, stage_durations
from .profile import Profile
from .space import AUTO, CACHES, ORDERS, VSHAPE_ORDERS, Point, Variant, order_fits, placements, schemes_at, vshape_fits

#: ``order=auto`` is searched at the placements of this many of the best candidates (distinct
#: ``(B, G, R)``, the V shape apart): each of its steps costs a search of its own
AUTO_TOP = 3


@dataclass(frozen=True)
class Budget:
    """Per-worker budget: live activations and/or bytes (``None``: no limit of that kind).
    ``copies`` (``fault.copies``): 1 when each worker also keeps a copy of the previous worker's
    lone stages, sent after every step (:mod:`launcher.schedule.copies`): its bytes count against
    ``bytes``, and its traffic and link time are added to each candidate's."""

    activations: int | None = None
    bytes: float | None = None
    copies: int = 0


@dataclass
class Candidate:
    """One evaluated point and what the simulator predicts for it."""

    point: Point
    step_time: float  # seconds with a profile, duration units without
    bubble: float
    peak_activations: list[int]
    peak_bytes: list[float] | None
    traffic_messages: int
    traffic_bytes: float | None
    #: what runs: the scheme, the effective weight cache, and every worker's jobs in order;
    #: candidates that share it are one schedule reached by different settings
    same_as: tuple = field(default=(), compare=False, repr=False)

    @property
    def throughput(self) -> float:
        """Micro-batches per second (per duration unit without a profile)."""
        return self.point.microbatches / self.step_time

    @property
    def overrides(self) -> list[str]:
        return self.point.overrides()

    def key(self) -> tuple:
        """Rank: time per micro-batch (the step time when one micro-batch count is tried), then
        less traffic, less memory, and the plainer setting (no split, a named order rather than a
        searched one, no limit, cache step)."""
        p = self.point
        return (self.step_time / p.microbatches, self.traffic_bytes or 0.0, self.traffic_messages,
                max(self.peak_bytes) if self.peak_bytes else 0.0, max(self.peak_activations),
                p.split, p.order == "auto", p.memory_limit is not None, p.weight_cache != "step",
                p.recompute != "none")

    def to_json(self) -> dict[str, Any]:
        p = self.point
        return {
            "scheme": p.scheme.label, "G": p.G, "R": p.R, "W": p.G * p.R, "stages": p.stages,
            "microbatches": p.microbatches, "order": p.order, "warmup": p.warmup, "split_backward": p.split,
            "memory_limit": list(p.memory_limit) if isinstance(p.memory_limit, tuple) else p.memory_limit,
            "weight_cache": p.weight_cache, "partition": p.partition, "recompute": p.recompute,
            "step_time": self.step_time,
            "throughput": self.throughput,
            "bubble": self.bubble, "peak_activations": self.peak_activations, "peak_bytes": self.peak_bytes,
            "traffic_messages": self.traffic_messages, "traffic_bytes": self.traffic_bytes,
            "overrides": self.overrides,
        }


@dataclass
class Ranking:
    """The ranked candidates that fit (best first) and what the search did."""

    candidates: list[Candidate]
    simulated: int = 0
    pruned_time: int = 0
    pruned_memory: int = 0
    did_not_fit: int = 0
    equivalent: int = 0  # candidates that were the same schedule as one listed
    auto_searched: int = 0  # placements (B, G, R, the V shape apart) where order=auto was searched
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None


def _neg(key: tuple) -> tuple:
    return tuple(-x for x in key)


def _durations(prof: Profile, split: bool) -> dict[str, float]:
    d = dict(prof.durations)
    if d["I"] is None or d["W"] is None:  # not measured: unused unless split (then not searched)
        b = d["B"]
        assert b is not None  # a profile always has F and B; only the split backward's I and W may lack
        d["I"] = d["W"] = b / 2
    return {k: float(v) for k, v in d.items() if v is not None}


def time_bound(S: int, B: int, G: int, R: int, split: bool, d: dict[str, float], comm: float,
               stages: Sequence[Mapping[str, float]] | None = None, vshape: bool = False,
               work_only: bool = False) -> float:
    """``max(work, chain)`` of the module docstring: no schedule of this step is shorter.
    ``stages``: per stage its own durations (then ``work`` is the busiest worker's, whose stages
    are ``s = r (mod R)``, and ``chain`` sums the stages' own times). ``vshape``: the V shape's
    placement instead (worker ``min(s, S - 1 - s)`` runs stage ``s`` of every micro-batch).
    ``work_only``: ``work`` alone, the bound of a step that overlaps the next (its chain does not
    bind: the next step's forwards fill its drain)."""
    if work_only:
        return _work_bound(S, B, G, R, split, d, stages, vshape)
    if vshape:
        return _vshape_bound(S, B, split, d, comm, stages)
    if stages is not None:
        t = [{k: float(st.get(k, d[k])) for k in ("F", "B", "I", "W")} for st in stages]
        job = [x["F"] + (x["I"] + x["W"] if split else x["B"]) for x in t]
        work = math.ceil(B / G) * max(sum(job[s] for s in range(r, S, R)) for r in range(R))
        chain = sum(x["F"] + (x["I"] if split else x["B"]) for x in t) + (min(x["W"] for x in t) if split else 0.0)
        return max(work, chain + (2 * (S - 1) * comm if R > 1 else 0.0))
    back = d["I"] + d["W"] if split else d["B"]
    work = math.ceil(S / R) * math.ceil(B / G) * (d["F"] + back)
    chain = S * d["F"] + S * (d["I"] if split else d["B"]) + (d["W"] if split else 0.0)
    chain += 2 * (S - 1) * comm if R > 1 else 0.0
    return max(work, chain)


def _work_bound(S: int, B: int, G: int, R: int, split: bool, d: dict[str, float],
                stages: Sequence[Mapping[str, float]] | None, vshape: bool) -> float:
    """The busiest worker's total job time: ``work`` of :func:`time_bound`."""
    t = [{k: float((stages[s] if stages else {}).get(k, d[k])) for k in ("F", "B", "I", "W")} for s in range(S)]
    job = [x["F"] + (x["I"] + x["W"] if split else x["B"]) for x in t]
    if vshape:
        return B * max(job[w] + job[S - 1 - w] for w in range(S // 2))
    return math.ceil(B / G) * max(sum(job[s] for s in range(r, S, R)) for r in range(R))


def _vshape_bound(S: int, B: int, split: bool, d: dict[str, float], comm: float,
                  stages: Sequence[Mapping[str, float]] | None) -> float:
    """:func:`time_bound` on the V shape: worker ``w`` runs stages ``w`` and ``S - 1 - w`` of all
    ``B`` micro-batches; the chain crosses workers at every stage boundary but the V's turn
    (stages ``S/2 - 1`` and ``S/2`` share a worker), in both directions."""
    t = [{k: float((stages[s] if stages else {}).get(k, d[k])) for k in ("F", "B", "I", "W")} for s in range(S)]
    job = [x["F"] + (x["I"] + x["W"] if split else x["B"]) for x in t]
    work = B * max(job[w] + job[S - 1 - w] for w in range(S // 2))
    chain = sum(x["F"] + (x["I"] if split else x["B"]) for x in t) + (min(x["W"] for x in t) if split else 0.0)
    return max(work, chain + 2 * max(0, S - 2) * comm)


def _traffic_bytes(t: dict[str, list[int]], fetch: list[int], prof: Profile, S: int) -> float | None:
    """Counts times mean per-stage bytes: activations for act/grad/stash messages, parameters for
    weight fetches, gradients for sums sent to owners and replica reductions."""
    if not prof.bytes:
        return None
    mean = {k: sum(prof.stage_bytes(k, s) for s in range(S)) / S for k in ("activation", "params", "grads")}
    return (mean["activation"] * sum(t["act_recv"]) + mean["activation"] * sum(t["grad_recv"])
            + mean["activation"] * sum(t["stash_recv"]) + mean["params"] * sum(fetch)
            + mean["grads"] * (sum(t["weight_grad_send"]) + sum(t["weight_allreduce"])))


def graph_shares(prof: Profile, S: int) -> float | tuple[float, ...]:
    """Per stage, the share of a micro-batch's activation bytes that is its forward's graph (the
    profile's ``saved`` over ``activation`` plus ``saved``: the one memory model's split,
    :mod:`launcher.schedule.activations`); without profiled bytes, the default."""
    if not prof.bytes:
        return GRAPH_SHARE
    out: list[float] = []
    for s in range(S):
        a, g = prof.stage_bytes("activation", s), prof.stage_bytes("saved", s)
        out.append(g / (a + g) if a + g > 0 else GRAPH_SHARE)
    return out[0] if len(set(out)) == 1 else tuple(out)


def _limits(budget: Budget, prof: Profile, owned: list[set[int]], fetched: list[set[int]],
            S: int) -> int | tuple[int, ...] | None:
    """Per worker, the most activations that fit beside its weights under cache ``step``
    (``None`` when no byte budget): the largest per-stage activation times the count fits."""
    if budget.bytes is None or not prof.bytes:
        return None
    base = memory.static_bytes(owned, fetched, prof)
    copies = [sum(prof.stage_bytes("params", s) for s in f) for f in fetched]
    # a unit of the one memory model: a stage's micro-batch input plus its graph
    a = max(prof.stage_bytes("activation", s) + prof.stage_bytes("saved", s) for s in range(S)) or 1.0
    # at least 1: a limit is a positive count (the rules refuse 0); a step whose peak then breaks the
    # byte budget is not kept (the fit is checked on the simulated peaks)
    lim = tuple(max(1, int((budget.bytes - b - c) // a)) for b, c in zip(base, copies))
    return lim if len(set(lim)) > 1 else lim[0]  # one int when every worker gets the same


def search(S: int, microbatches: Sequence[int], workers: int, prof: Profile, budget: Budget,
           top: int = 20, auto_top: int = AUTO_TOP, step_overlap: str = DEFAULT.step_overlap) -> Ranking:
    """The fastest fitting points of the space, best first (see the module docstring). With a
    profile of the model's modules (``prof.modules``) the cut of the modules into ``S`` stages is
    searched too: each partition (:mod:`launcher.plan.partition`) gives its stages their own
    durations and bytes, and its candidates carry ``partition=...``. ``auto_top``: at how many of
    the best candidates' placements ``order=auto`` is searched (0: never). ``step_overlap``: the
    rule a step's time is priced under (:mod:`launcher.schedule.overlap`; module docstring)."""
    if not prof.modules:
        return _search(S, microbatches, workers, prof, budget, top, auto_top, step_overlap)
    merged = Ranking([])
    seen: list[list[list[int]]] = []
    for by, staged in partitioned(prof, S, max(microbatches), budget.bytes):
        if staged[0] in seen:
            continue  # the same cut as a partition searched already
        seen.append(staged[0])
        found = _search(S, microbatches, workers, staged[1], budget, top, auto_top, step_overlap)
        for c in found.candidates:
            c.point = replace(c.point, partition=by)
            c.same_as = (by,) + tuple(c.same_as)
        merged.candidates += found.candidates
        for k in ("simulated", "pruned_time", "pruned_memory", "did_not_fit", "equivalent", "auto_searched"):
            setattr(merged, k, getattr(merged, k) + getattr(found, k))
    merged.candidates = sorted(merged.candidates, key=Candidate.key)[:top]
    return merged


def partitioned(prof: Profile, S: int, inflight: int,
                cap: float | None) -> list[tuple[str, tuple[list[list[int]], Profile]]]:
    """Per partition of ``prof.modules`` into ``S`` stages that can be cut (``time`` within ``cap``
    bytes per stage, ``inflight`` micro-batches' activations counted), its groups and the profile
    of its stages: per stage the sums of its modules' seconds and bytes."""
    mods = prof.modules or ()
    if len(mods) < S:
        return []
    col = {k: [m[k] for m in mods] for k in ("forward_s", "backward_s", "params", "grads", "optimizer", "activation")}
    memory = [m["params"] + m["grads"] + m["optimizer"] + inflight * m["activation"] for m in mods]
    seconds = [f + b for f, b in zip(col["forward_s"], col["backward_s"])]
    out = []
    for by in PARTITIONS:
        try:
            groups = cut(by, S, col["params"], seconds, memory, cap)
        except PartitionError:
            continue  # no cut of this kind fits the budget
        per = stage_durations(col["forward_s"], col["backward_s"], groups)
        table = {k: tuple(group_sums(col[k], groups)) for k in ("params", "grads", "optimizer", "activation")}
        staged = replace(prof, stage_durations=tuple(per), bytes=table)
        out.append((by, (groups, staged)))
    return out


def _search(S: int, microbatches: Sequence[int], workers: int, prof: Profile, budget: Budget,
            top: int = 20, auto_top: int = AUTO_TOP, step_overlap: str = DEFAULT.step_overlap) -> Ranking:
    """:func:`search` for one cut of the model into stages (the profile's)."""
    plan = Ranking([])
    graph_share = graph_shares(prof, S)
    kept: list[list] = []  # a max-heap of [negated key, serial, candidate]: the top ``top`` candidates
    listed: dict[tuple, list] = {}  # schedule -> its entry in ``kept``
    serial = itertools.count()
    # (bound, tiebreak, B, G, R, vshape, split, order, warmup, recompute)
    jobs: list[tuple[float, int, int, int, int, bool, bool, str, str, str]] = []
    # recomputation trades an extra forward per backward for the forwards' graphs: searched only
    # under a byte budget, and only when the profile knows what those graphs hold
    recomputes = ("none", "full") if budget.bytes is not None and prof.bytes and prof.bytes.get("saved") else ("none",)
    for B in microbatches:
        spots = [(G, R, False) for G, R in placements(workers, S, B)]
        if vshape_fits(workers, S, B):
            spots.append((1, S // 2, True))
        for G, R, v in spots:
            for split in (False, True):
                if split and not prof.can_split:
                    continue
                for rc in recomputes:
                    lb = _bound(S, B, G, R, v, split, rc, prof, step_overlap)
                    for order, warmup in VSHAPE_ORDERS if v else ORDERS:
                        if not order_fits(order, R, S, split, v, B):
                            continue  # split-only orders, interleaving only when looped, ZB-V on the V shape
                        jobs.append((lb / B, len(jobs), B, G, R, v, split, order, warmup, rc))
    jobs.sort()
    static: dict[tuple[int, int, int, bool], Any] = {}
    traffic_of: dict[tuple, dict] = {}

    def worst() -> float:
        """The time per micro-batch a candidate must beat to enter the top (inf while it is not full)."""
        return -kept[0][0][0] if len(kept) >= top else math.inf

    def run(lb: float, B: int, G: int, R: int, v: bool, split: bool, order: str, warmup: str, rc: str,
            limits: Sequence[Any], scan: bool) -> None:
        """Simulate one step under each memory limit of ``limits`` (and, with ``scan``, the upward
        scan of the module docstring when the unlimited step does not fit); keep what enters the top."""
        per_scheme, _, least = static[B, G, R, v]
        d = _durations(prof, split)
        queue = list(limits)
        scanning, i = False, 0
        while i < len(queue):
            ml = queue[i]
            i += 1
            if lb > worst():
                break  # the top filled up meanwhile: no limit of this step can enter it
            try:
                tl = simulate(make_schedule("vshape" if v else "lpp", S, B, G, R, order=order, warmup=warmup,
                                        durations=d, comm=prof.comm, memory_limit=ml, split_backward=split,
                                        stage_durations=prof.stage_table(S), recompute=rc,
                                        step_overlap=step_overlap, graph_share=graph_share))
            except ScheduleError:
                continue  # this limit cannot finish the step (order=auto: it found no schedule within it)
            plan.simulated += 1
            found = _evaluate(tl, per_scheme, B, G, R, order, warmup, split, ml, d, prof, budget, plan,
                              traffic_of.setdefault((B, G, R, v, split, rc), {}), worst() * B, step_overlap)
            if scan and ml is None and not found and (budget.activations is not None or budget.bytes is not None):
                # The unlimited step does not fit: scan uniform limits upward from the least that
                # can finish. The greedy scheduler is not monotone in the limit (a limit above the
                # budget can leave the peak inside it), so the scan goes on past the budget until
                # a limit whose step does not fit, or the unlimited peak.
                scanning = True
                top_first = max((m if isinstance(m, int) else max(m) for m in queue if m is not None), default=0)
                queue += [m for m in range(least, max(tl.peak_activations)) if m not in queue]
            elif scanning and not found and isinstance(ml, int) and ml > top_first:
                break
            for cand in found:
                _keep(kept, listed, cand, top, next(serial), plan)
            if found and found[0].step_time / B <= lb * (1 + 1e-12):
                break  # reached the time bound: no other limit of this step is faster

    for lb, _, B, G, R, v, split, order, warmup, rc in jobs:
        if lb > worst():
            plan.pruned_time += 1
            continue
        if (B, G, R, v) not in static:
            static[B, G, R, v] = _static(S, B, G, R, prof, budget, v)
        if not static[B, G, R, v][0]:
            plan.pruned_memory += 1
            continue
        run(lb, B, G, R, v, split, order, warmup, rc, static[B, G, R, v][1], scan=True)

    # order=auto costs a search per step: only at the placements of the best candidates so far,
    # under the limits tried first there and those the listed candidates there use (its sequences
    # keep to a limit themselves, so no upward scan)
    if auto_top > 0 and prof.can_split:
        best_first = sorted((c for _, _, c in kept), key=Candidate.key)
        at: dict[tuple[int, int, int, bool, str], list[Any]] = {}  # placement -> its limits
        for c in best_first:
            p = c.point
            spot = (p.microbatches, p.G, p.R, p.scheme.name == "vshape", p.recompute)
            if spot not in at and len(at) >= auto_top:
                continue
            lims = at.setdefault(spot, list(static[spot[:4]][1]))
            if p.memory_limit not in lims:
                lims.append(p.memory_limit)
        for (B, G, R, v, rc), lims in at.items():
            lb = _bound(S, B, G, R, v, True, rc, prof, step_overlap) / B
            if lb > worst():
                plan.pruned_time += 1
                continue
            plan.auto_searched += 1
            run(lb, B, G, R, v, True, *AUTO, rc, lims, scan=False)
    plan.candidates = sorted((c for _, _, c in kept), key=Candidate.key)
    return plan


def _bound(S: int, B: int, G: int, R: int, v: bool, split: bool, rc: str, prof: Profile,
           step_overlap: str = DEFAULT.step_overlap) -> float:
    """:func:`time_bound` of one step of the search (its recomputation charged), plus the time
    outside the engine; overlapping steps fill and drain each other, so only the work binds them."""
    d = _durations(prof, split)
    table = prof.stage_table(S) if rc == "none" else _recomputed_table(S, split, d, prof.stage_table(S))
    overlap = step_overlap != DEFAULT.step_overlap
    return time_bound(S, B, G, R, split, d, prof.comm, table, vshape=v, work_only=overlap) + prof.outside


def _keep(kept: list[list], listed: dict[tuple, list], cand: Candidate, top: int, serial: int, plan: Ranking) -> None:
    """Enter ``cand`` into the top ``top`` unless a plainer setting of the same schedule is there."""
    old = listed.get(cand.same_as)
    if old is not None and old in kept:
        plan.equivalent += 1
        if cand.key() < old[2].key():  # the same schedule under plainer settings: list those
            old[0], old[2] = _neg(cand.key()), cand
            heapq.heapify(kept)
        return
    entry = [_neg(cand.key()), serial, cand]
    if len(kept) < top:
        heapq.heappush(kept, entry)
    elif cand.key() < _neg(kept[0][0]):
        dropped = heapq.heapreplace(kept, entry)
        listed.pop(dropped[2].same_as, None)
    else:
        return
    listed[cand.same_as] = entry


def _static(S: int, B: int, G: int, R: int, prof: Profile, budget: Budget,
            vshape: bool = False) -> tuple[list, list, int]:
    """Per scheme at ``(G, R)`` (``vshape``: the V shape, on ``G R = S/2`` workers): its weights per
    job, if the memory bound lets it fit; the memory limits to simulate first (none, the activation
    budget, each scheme's byte-derived limit); and the least limit that can finish the step."""
    probe = make_schedule("vshape" if vshape else "lpp", S, B, G, R)
    compute, _ = place_all(probe)
    # each worker needs one activation per stage it computes, all live at once (worker R g + r
    # holds the stages s = r (mod R); on the V shape, stages w and S - 1 - w)
    held: list[set[int]] = [set() for _ in range(G * R)]
    for j in range(S * B):  # the forwards: job j is stage j // B
        held[compute[j]].add(j // B)
    need = [len(h) for h in held]
    per_scheme = []
    limits: list[Any] = [None]
    if budget.activations is not None:
        if max(need) > budget.activations:
            return [], [], 0
        limits.append(budget.activations)
    for sch in [Variant("vshape")] if vshape else schemes_at(G, R, S, B):
        probe.placement = named(sch.name, G, R, sch.ownership)
        _, weights = place_all(probe)
        tl = Timeline(probe, compute, weights, [], [], [], [])
        owned, fetched = memory.owned_and_fetched(tl)
        if budget.bytes is not None and prof.bytes:
            base = memory.static_bytes(owned, fetched, prof, "job")  # the smaller of the two caches
            a_min = min(prof.stage_bytes("activation", s) for s in range(S))
            p_min = [min((prof.stage_bytes("params", s) for s in f), default=0.0) for f in fetched]
            if max(b + p + n * a_min for b, p, n in zip(base, p_min, need)) > budget.bytes:
                continue  # cannot fit under either cache, whatever the order
            lim = _limits(budget, prof, owned, fetched, S)
            if lim is not None and budget.activations is not None:
                lim = (min(lim, budget.activations) if isinstance(lim, int)
                       else tuple(min(x, budget.activations) for x in lim))
            if lim is not None and lim not in limits:
                limits.append(lim)
        per_scheme.append((sch, weights[: S * B], owned, fetched))  # direction-free: one (s, b) each
    return per_scheme, limits, max(need)


def _evaluate(tl: Timeline, per_scheme: list, B: int, G: int, R: int, order: str, warmup: str, split: bool,
              ml: Any, d: dict[str, float], prof: Profile, budget: Budget, plan: Ranking,
              moves: dict, worst: float = math.inf, step_overlap: str = DEFAULT.step_overlap) -> list[Candidate]:
    """Every scheme, ownership and cache on one simulated timeline, keeping those that fit.
    Under an overlap (``step_overlap``), a step's time is its steady state's step cost
    (:func:`~launcher.schedule.overlap.steady_state`, on the profile's shared cores where it has
    them, no link model) and its
    bubble the idle share of that.
    ``moves`` caches each scheme's traffic and gradient exchange tails: they depend on the placement
    and the split only.
    ``worst``: the step time a candidate must beat to enter the top (cache ``job``, never faster than
    cache ``step`` when every worker has a core, is then timed only when that beats it)."""
    S = tl.schedule.S
    overlap = step_overlap != DEFAULT.step_overlap
    latency = steady_state(tl, step_overlap).step_cost if overlap else tl.latency
    busy = sum(tl.schedule.duration_table(d)) * B  # every kind of every stage, each stage its own time
    bubble = max(0.0, 1.0 - busy / (tl.schedule.workers * latency))  # no bubble: 0, not -1e-16 (shown -0.000)
    peak_act = list(tl.peak_activations)
    if budget.activations is not None and max(unit_peaks(tl)) > budget.activations + 1e-9:  # the one memory model
        plan.did_not_fit += len(per_scheme) * len(CACHES)
        return []
    act = memory.activation_bytes(tl, prof) if prof.bytes else None
    # cache "job": forwards on fetched copies keep no graph (their backward recomputes them)
    job_act = prof.bytes is not None and bool(prof.bytes.get("saved")) and len(tl.schedule.recompute) < S
    rc = "full" if tl.schedule.recompute else "none"
    out = []
    step_time: dict = {}
    link = prof.link
    grads = [prof.stage_bytes("grads", s) for s in range(S)] if link and prof.bytes else None
    programs = tuple(map(tuple, tl.sequences))
    monotone = prof.cores is None or prof.cores >= tl.schedule.workers  # see job_cache_time
    # per job work on CPU workers: the jobs and their activations and gradients depend on where jobs
    # run only, the same for every scheme here; the weight messages on who owns what (below)
    work = job_work(tl, d, prof.message_cpu) if prof.cores is not None else None
    mlt = tuple(ml) if isinstance(ml, (list, tuple)) else ml
    g = tl.schedule.graph_share
    share = float(g) if isinstance(g, (int, float)) else tuple(g)
    for sch, weights, owned, fetched in per_scheme:
        view = Timeline(tl.schedule, tl.compute, weights * tl.schedule.space.K, tl.start, tl.finish, tl.sequences,
                        tl.peak_activations)
        cached: tuple[dict[str, list[int]], list[float] | None] | None = moves.get(sch)
        if cached is None:
            # the gradient exchange after the compute (its tails) depends on who owns what
            tails = end_of_step(view, grads, link, prof.shared_reduce) if grads and link is not None else None
            cached = moves[sch] = (traffic(view), tails)
        t, tails = cached
        # fault.copies=1: the lone stages' state sent round the ring after the step, and the copy kept
        sent_stages = ring_copies(owned)[0] if budget.copies else [set() for _ in owned]
        sent_b, kept_b = memory.copies_of(owned, prof) if budget.copies and prof.bytes else (None, None)
        # the ring's messages travel at once, after the optimizer step: the largest one's link time
        copy_s = max((link.seconds(b) for b in sent_b if b), default=0.0) if sent_b and link is not None else 0.0
        if overlap and prof.cores is not None:  # CPU workers share the cores across the overlapping steps too
            # the global state's messages are a few bytes: the link's latency (as metrics.json prices them)
            step_time[sch] = steady_state(view, step_overlap, cores=prof.cores,
                                          work=_weight_work(work, view, "step", prof),
                                          tails=[prof.outside] * tl.schedule.workers,
                                          state_comm=prof.link.latency_s if prof.link else None).step_cost
        elif overlap:  # who owns what decides when each stage steps, and so the next step's start
            step_time[sch] = steady_state(view, step_overlap).step_cost + prof.outside
        elif prof.cores is not None:  # CPU workers: they share the cores
            step_time[sch] = shared_cores_time(view, prof, grads, _weight_work(work, view, "step", prof))
        else:
            step_time[sch] = ((link_step_time(view, grads, link, tails) if grads and link is not None else latency)
                              + prof.outside)
        recompute = step_time[sch]
        # cache "job" (backwards on fetched weights recompute their forward) lasts at least as long
        # where every worker has a core; on shared cores more work can reorder who waits for whom
        if any(fetched) and not overlap and (not monotone or step_time[sch] <= worst):
            recompute = job_cache_time(view, prof, grads, d, step_time[sch], tails,
                                       _weight_work(work, view, "job", prof))
        step_fits = False
        for cache in CACHES:
            seconds = (recompute if cache == "job" else step_time[sch]) + copy_s
            if cache == "job" and monotone and step_fits and seconds > worst:
                continue  # slower than the whole top, and cache step fits: the scan learns nothing more
            if cache == "job" and overlap and any(fetched):
                continue  # its recomputing backwards are not priced under an overlap: cache step only
            if cache == "job" and not any(fetched):
                fetch, resident = [0] * len(owned), t["weights_owned"]
            elif cache == "job":
                fetch, _, held = _job_cache(view)
                resident = [o + h for o, h in zip(t["weights_owned"], held)]
            else:
                fetch, resident = (t["weight_fetch_stages"],
                                   [o + f for o, f in zip(t["weights_owned"], t["weight_fetch_stages"])])
            act_c = memory.activation_bytes(view, prof, cache) if cache == "job" and job_act and any(fetched) else act
            peak_bytes = (memory.worker_bytes(view, prof, cache, resident, owned, fetched, act_c)
                          if act_c is not None else None)  # None exactly when act is (no profiled bytes)
            if peak_bytes is not None and kept_b is not None:
                peak_bytes = [b + k for b, k in zip(peak_bytes, kept_b)]
            if budget.bytes is not None and peak_bytes is not None and max(peak_bytes) > budget.bytes:
                plan.did_not_fit += 1
                continue
            msgs = sum(t["act_recv"]) + sum(t["grad_recv"]) + sum(t["stash_recv"]) + sum(fetch) \
                + sum(t["weight_grad_send"]) + sum(t["weight_allreduce"]) + sum(1 for st in sent_stages if st)
            traffic_b = _traffic_bytes(t, fetch, prof, S)
            if traffic_b is not None and sent_b is not None:
                traffic_b += sum(sent_b)
            point = Point(sch, G, R, S, B, order, warmup, split, mlt, cache, d, prof.comm, recompute=rc,
                          step_overlap=step_overlap, graph_share=share)
            # what runs: each worker's jobs in order (the runtime runs them as soon as they can
            # start, whatever waits chose that order) and who owns which weights; FSLPP's two ownerships
            # coincide when R = 1, and DDP is LPP at G = B
            runs = (tuple(weights), cache if any(fetched) else "step", split, B, G, R, programs, rc)
            out.append(Candidate(point, seconds, bubble, peak_act, peak_bytes, msgs, traffic_b, runs))
            step_fits = cache == "step"
    return out


def _weight_work(work: list[float] | None, tl: Timeline, cache: str, prof: Profile) -> list[float] | None:
    """``work`` (per job, on CPU workers) plus the CPU of the weight copies and partial sums the
    workers move under ``cache`` (:func:`~launcher.schedule.lowering.weight_messages`)."""
    if work is None or not prof.message_cpu or tl.owner == tl.compute:
        return work
    return with_weight_messages(work, tl, cache, prof.message_cpu)


def with_recompute(tl: Timeline, d: dict[str, float], message_s: float | None = None,
                   work: Sequence[float] | None = None) -> list[float]:
    """Per job, its work (:func:`~launcher.schedule.cores.job_work`, or ``work`` when already
    known) under weight cache ``job``: a backward (``B``, or ``I`` when split) on fetched weights
    fetches them again and recomputes its forward first (:func:`launcher.schedule.lowering.add_weights`), so it also
    lasts an ``F``."""
    S, B = tl.schedule.space.S, tl.schedule.space.microbatches
    base = job_work(tl, d, message_s, "job") if work is None else work
    forward = tl.schedule.duration_table(d)[:S]  # kind F first: each stage's own forward
    rc = tl.schedule.recompute  # those backwards recompute already (charged in the base work)
    return [w + (forward[(j // B) % S] if j // (S * B) == 1 and tl.owner[j] != tl.compute[j]
                 and (j // B) % S not in rc else 0.0)
            for j, w in enumerate(base)]


def _recomputed_table(S: int, split: bool, d: dict[str, float],
                      stages: Sequence[Mapping[str, float]] | None) -> list[dict[str, float]]:
    """Per stage, its durations with the backward (``B``, or ``I`` when split) lasting its
    forward more: what ``recompute=full`` charges (for the time bound)."""
    bwd = "I" if split else "B"
    out = []
    for s in range(S):
        t = {k: float((stages[s] if stages else {}).get(k, d[k])) for k in ("F", "B", "I", "W")}
        t[bwd] += t["F"]
        out.append(t)
    return out


def job_cache_time(tl: Timeline, prof: Profile, grads: Sequence[float] | None, d: dict[str, float],
                   base: float, tails: Sequence[float] | None = None,
                   work: Sequence[float] | None = None) -> float:
    """The step under weight cache ``job`` (:func:`with_recompute`), given ``base``, its time
    under cache ``step``: replayed on shared cores like any candidate of a CPU profile; with a
    processor each, ``base`` plus what the recomputation adds to the replay of the programs
    (adding work to fixed programs delays no job, so it is never below ``base``). On shared cores
    it can be below: a job delayed by the recomputation may stop competing for a core when another
    worker's critical job needs it. ``work``: the jobs' work with their messages under cache ``job``
    (its weight copies and partial sums), before the recomputation, when known."""
    work = with_recompute(tl, d, prof.message_cpu if prof.cores is not None else None, work)
    if prof.cores is not None:
        return shared_cores_time(tl, prof, grads, work, "job")
    if tails is None and grads and prof.link:
        tails = end_of_step(tl, grads, prof.link, prof.shared_reduce)
    W = tl.schedule.workers
    return base + replay(tl, W, tails, durations=work).seconds - replay(tl, W, tails).seconds


def shared_cores_time(tl: Timeline, prof: Profile, grads: Sequence[float] | None,
                      work: Sequence[float] | None = None, cache: str = "step") -> float:
    """The step under weight cache ``cache`` when its workers share ``prof.cores`` cores (``work``:
    per job, instead of the step's durations): the programs replayed, then
    on every worker the gradient exchange (its bytes over the link as work, its message rounds as
    waits of ``prof.comm`` each, the message time measured on the workers), each message's CPU
    (``prof.message_cpu``) on the jobs that move it, each weight copy arriving a message's time
    after its owner hands it over (:func:`~launcher.schedule.lowering.weight_arrivals`), and the work
    outside the engine (a training step sums its loss over every worker there, so each waits for all)."""
    W = tl.schedule.workers
    ex = exchanges(tl, grads, prof.shared_reduce) if grads else None
    tails = [(max(e.sent, e.received) / prof.link.bytes_per_s if prof.link else 0.0) + prof.outside for e in ex] \
        if ex else [prof.outside] * W
    delays = [e.rounds * prof.comm for e in ex] if ex else None
    if work is None:
        work = job_work(tl, tl.schedule.durations, prof.message_cpu, cache)
    fetched = weight_arrivals(tl, cache, DEFAULT.prefetch) if tl.owner != tl.compute else None
    return replay(tl, prof.cores or W, tails, [list(range(W))] * W, delays, durations=work, fetched=fetched).seconds
