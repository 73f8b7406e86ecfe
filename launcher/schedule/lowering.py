"""Lower a simulated :class:`~launcher.schedule.Timeline` into one program per worker.

Pure Python, no torch. Every worker calls :func:`lower` on the same timeline and gets the same
:class:`~launcher.schedule.program.Lowered`, so every send has its matching receive without a
coordinator.

What the placement implies (docs/design.md, "Placement and data movement") is lowered by passes
over one list of :class:`~launcher.schedule.actions.Action` per worker, each pass documenting the
traffic it adds: the jobs in timeline order (:func:`job_actions`), then :data:`PASSES`: ``act``
and ``grad`` messages (:func:`add_act_grad`, one per edge of :func:`edges`), ``weights`` under the
weight cache policy (:func:`add_weights`), ``wgrad`` (:func:`add_wgrad`), the replicas'
all-reduces (:func:`add_reduces`), and last the engine's lookahead, resolved to positions
(:func:`post_early`). :func:`~launcher.schedule.assembly.assemble` then pairs every send with its
receive, keys and numbers the messages in the order NCCL needs and fills each worker's
:class:`~launcher.schedule.program.Program`, whose operations are those actions one for one, in
order (the engine runs them as they stand). :func:`lower_actions` gives the lists themselves:
:func:`~launcher.schedule.actions.format_programs` prints them, one line per worker, and
:func:`assemble` of what :func:`~launcher.schedule.actions.parse_programs` reads back is the
same lowered step. :func:`lower` takes the ``act``/``grad`` messages (most of a step's) straight
from :func:`edges` rather than pairing their sends and receives again.
"""

from __future__ import annotations

import gc
from bisect import bisect_left
from collections import defaultdict, deque
from contextlib import contextmanager
from typing import Iterator

from .actions import (
    FREE_WEIGHTS,
    FREE_WGRAD,
    JOBS,
    POSTED,
    RECV_ACT,
    RECV_GRAD,
    RECV_WEIGHTS,
    RECV_WGRAD,
    REDUCE,
    SEND_ACT,
    SEND_GRAD,
    SEND_WEIGHTS,
    SEND_WGRAD,
    Action,
    weave,
)
from .activations import sum_handovers
from .assembly import (
    OP,
    Edge,
    Programs,
    assemble,
    assemble_with,
    check_options,
    marked_error,
    stage_owners,
    timeline_jobs,
)
from .assembly import LoweringError as LoweringError  # what lowering raises, with it: callers catch it here
from .order_file import file_placed
from .program import ACT, GRAD, Lowered
from .settings import DEFAULT
from .simulate import Timeline

Slots = list[defaultdict[int, list[Action]]]  # per worker, job index -> actions to weave in beside that job


def _slots(tl: Timeline) -> tuple[Slots, Slots]:
    return [defaultdict(list) for _ in tl.sequences], [defaultdict(list) for _ in tl.sequences]


def _positions(tl: Timeline) -> list[int]:
    """Each job's index in its worker's program."""
    at = [0] * tl.schedule.space.N
    for prog in tl.sequences:
        deque(map(at.__setitem__, prog, range(len(prog))), maxlen=0)  # at[j] = i, without a Python loop
    return at


def _all_on_own_weights(tl: Timeline) -> bool:
    """Whether every job computes on its own worker's weights (DDP, GPipe, LPP): nothing to fetch,
    no partial sum to send."""
    return tl.owner == tl.compute


def job_actions(tl: Timeline) -> Programs:
    """Each worker's jobs in timeline order. Every job of ``(s, b)`` must run where ``F(s, b)``
    ran: its activation stash lives there."""
    space, progs = tl.schedule.space, timeline_jobs(tl)
    SB = space.S * space.microbatches
    for j in range(SB, space.N):
        if tl.compute[j] != tl.compute[j % SB]:
            s, b, d = space.job(j)
            w = tl.compute[j]
            raise marked_error(progs, (w, tl.sequences[w].index(j)),
                          f"placement {tl.schedule.name} runs F({s},{b}) on worker {tl.compute[j % SB]} but "
                          f"{d}({s},{b}) on worker {w}", "the runtime needs every job of a (stage, micro-batch) "
                          "on the worker that holds its activations")
    return progs


def edges(tl: Timeline) -> list[Edge]:
    """One message per edge of the job graph that crosses workers, in numbering order (by
    consuming job, then the producer's place among its predecessors, :meth:`JobSpace.pred`):

    - ``act``: ``F(p,b) -> F(c,b)`` across workers carries ``x_c^b`` (the output of stage ``p``);
    - ``grad``: backward ``(c,b) -> (p,b)`` across workers carries ``dL/d(output of p)``.

    A message's key is its producer's simulated finish (:func:`messages`)."""
    space, comp, finish = tl.schedule.space, tl.compute, tl.finish
    S, B = space.S, space.microbatches
    at = _positions(tl)
    out: list[Edge] = []
    # the edges of the job graph within a direction (JobSpace.pred), a stage's micro-batches at once
    for k, (graph, kind) in enumerate(((space.stage_preds, ACT), (space.stage_succs, GRAD))):
        for s in range(S):
            for place, ps in enumerate(graph[s]):
                j0, p0 = (k * S + s) * B, (k * S + ps) * B  # the consumer's and producer's job ids at b = 0
                x, y = (ps, s) if kind == ACT else (s, ps)  # the stage that produces the edge, and the other
                for b, cw, pw in zip(range(B), comp[j0 : j0 + B], comp[p0 : p0 + B]):
                    if cw != pw:
                        p, j = p0 + b, j0 + b
                        out.append((j * S + place, (finish[p], 0, p, j), kind, pw, cw, x, b, y, at[p], at[j]))
    out.sort(key=OP)
    return out


def add_act_grad(tl: Timeline, progs: Programs, weight_cache: str, found: list[Edge] | None = None) -> Programs:
    """The ``act`` and ``grad`` messages of :func:`edges` (``found``: those, already known), each
    sent after the job that produces it and received before the job that consumes it."""
    before, after = _slots(tl)
    for _, _, kind, pw, cw, x, b, y, ip, ic in edges(tl) if found is None else found:
        if kind == ACT:
            after[pw][ip].append(Action(SEND_ACT, x, b, cw, y))
            before[cw][ic].append(Action(RECV_ACT, y, b, pw, x))
        else:  # ``x`` receives the gradient of its output from ``y``
            after[pw][ip].append(Action(SEND_GRAD, y, b, cw, x))
            before[cw][ic].append(Action(RECV_GRAD, x, b, pw, y))
    return weave(progs, before, after)


def weight_fetches(tl: Timeline, weight_cache: str) -> Iterator[tuple[int, int, int, int, int]]:
    """Each weight copy :func:`add_weights` moves, as ``(worker, index, stage, owner, owner_index)``:
    the worker receives stage ``stage`` before the job at ``index`` of its program, and the owner
    hands it over before the job at ``owner_index`` of its own (its program's length: after its last
    job)."""
    if _all_on_own_weights(tl):
        return
    space = tl.schedule.space
    S, B, SB, kinds = space.S, space.microbatches, space.S * space.microbatches, space.kinds
    starts = [[tl.start[j] for j in prog] for prog in tl.sequences]
    for w, prog in enumerate(tl.sequences):
        cached: set[int] = set()
        for i, j in enumerate(prog):
            o = tl.owner[j]
            if o == w:
                continue
            q = j // B
            s, d = q % S, kinds[q // S]
            if weight_cache == "step" and s in cached:
                continue
            if weight_cache == "job" and (d == "W" or (d != "F" and tl.owner[j % SB] == w)):
                continue  # reuses the graph (and copy) of F or I: no transfer
            cached.add(s)
            yield w, i, s, o, bisect_left(starts[o], tl.start[j])


def add_weights(tl: Timeline, progs: Programs, weight_cache: str) -> Programs:
    """``weights``: a job with ``w_compute != w_owner`` runs on a copy of stage ``s`` sent by the
    owner ``w_owner``. With ``weight_cache="step"`` a worker fetches each stage once, for the
    first job that needs it, and keeps it to the end of the step; with ``"job"`` every such job
    fetches its own copy and frees it when it finishes, except that a backward whose forward ran on
    this worker's own weights backpropagates through that forward's graph (no copy), and a ``W``
    takes its gradient from its ``I``'s graph, on the copy ``I`` kept until then (no copy either).

    An owner's release point for a copy is just before its first job that starts at or after the
    consuming job's start (owners hold weights all step): just in time, so a consumer is never made
    to post a receive for weights it needs much later; :func:`post_early` then moves the hand-over
    ``prefetch`` jobs ahead of it. A copy names the micro-batch of the job it is for."""
    if _all_on_own_weights(tl):
        return progs
    before, after = _slots(tl)
    hand: list[tuple[int, int, float, int, Action]] = []  # (owner, its job index, consumer's start, consumer, send)
    for w, i, s, o, oi in weight_fetches(tl, weight_cache):
        j = tl.sequences[w][i]
        if weight_cache == "job":
            after[w][i].append(Action(FREE_WEIGHTS, s))
        b = tl.schedule.space.job(j)[1]
        before[w][i].append(Action(RECV_WEIGHTS, s, b, peer=o))
        hand.append((o, oi, tl.start[j], j, Action(SEND_WEIGHTS, s, b, peer=w)))
    for o, i, *_, send in sorted(hand, key=lambda h: h[:4]):  # in key order at each release point
        before[o][i].append(send)
    return weave(progs, before, after)


def early(i: int, prefetch: int) -> int:
    """The job before which an action that belongs before job ``i`` happens with lookahead
    ``prefetch``: ``prefetch`` jobs ahead, at the start of the step at the earliest. The one place
    the lookahead is applied (:func:`post_early`)."""
    return max(0, i - prefetch)


def post_early(tl: Timeline, progs: Programs, prefetch: int) -> Programs:
    """The lookahead, resolved: every receive of :data:`~launcher.schedule.actions.POSTED` moves
    from just before the job that needs it to :func:`early` of that job (where the worker posts
    it; the job waits for it where it stood), and every ``SEND_WEIGHTS`` from its owner's release
    point to :func:`early` of it (where the owner hands the copy over). The rest stays where it is."""
    if prefetch == 0:
        return progs
    moved = POSTED | {SEND_WEIGHTS}
    before: Slots = [defaultdict(list) for _ in progs]
    out: Programs = []
    for w, prog in enumerate(progs):
        if not any(a.op in moved for a in prog):
            out.append(prog)
            continue
        kept: list[Action] = []
        i = 0  # the job the next action before a job belongs to
        for a in prog:
            if a.op in JOBS:
                i += 1
            elif a.op in moved:
                before[w][early(i, prefetch)].append(a)
                continue
            kept.append(a)
        out.append(kept)
    return weave(out, before, [{} for _ in progs])


def weight_arrivals(tl: Timeline, weight_cache: str, prefetch: int) -> dict[int, int]:
    """Per job that receives a weight copy before it (:func:`weight_fetches`), the owner's job after
    which the copy is handed over, ``-1`` for the start of the step: an owner hands release point
    ``r`` over ``prefetch`` jobs ahead (:func:`early`), so the copy arrives a message's time after
    that, not before the consumer needs it."""
    out = {}
    for w, i, _s, o, oi in weight_fetches(tl, weight_cache):
        k = early(oi, prefetch) - 1  # after the owner's job k, or at the start
        out[tl.sequences[w][i]] = tl.sequences[o][k] if k >= 0 else -1
    return out


def weight_messages(tl: Timeline, weight_cache: str) -> list[int]:
    """Per job, the weight messages its worker moves while it runs: a copy received before it
    (:func:`add_weights`), a copy its owner hands over before it (after the owner's last job: at that
    job), and a partial gradient sum sent after it (:func:`add_wgrad`; the owner takes the sums in
    at the end of the step, outside the jobs). On CPU workers each costs the communication threads a
    core's time, like an activation (:func:`launcher.schedule.cores.job_work`)."""
    out = [0] * tl.schedule.space.N
    prog = tl.sequences
    for w, i, _s, o, oi in weight_fetches(tl, weight_cache):
        out[prog[w][i]] += 1
        if prog[o]:
            out[prog[o][min(oi, len(prog[o]) - 1)]] += 1
    for j in _partial_sums(tl).values():
        out[j] += 1
    return out


def add_wgrad(tl: Timeline, progs: Programs, weight_cache: str) -> Programs:
    """``wgrad``: each worker sends its weight-gradient sum of a stage to every other owner it
    computed for (one message per ``(stage, owner)``) as soon as its last backward of that stage
    for that owner ends, so the transfer overlaps the rest of its backward.

    The owner takes the sums in at the end of the step, by stage and sender; under
    ``weight_cache="job"`` a stage's only owner takes each in at one of its jobs, and the sender
    frees it once delivered (:func:`~launcher.schedule.activations.sum_handovers`), so no worker holds
    every fetched stage's sum to the end of the step."""
    if _all_on_own_weights(tl):
        return progs
    last = _partial_sums(tl)
    hand = {(h.stage, h.sender, h.owner): h for h in sum_handovers(tl)} if weight_cache == "job" else {}
    at = _positions(tl)
    before, after = _slots(tl)
    for (s, w, o), j in sorted(last.items(), key=lambda kv: (tl.finish[kv[1]], kv[1], kv[0][2])):  # in key order
        after[w][at[j]].append(Action(SEND_WGRAD, s, peer=o))
        h = hand.get((s, w, o))
        if h is not None and h.post is not None:
            before[o][h.post].append(Action(RECV_WGRAD, s, peer=w))
        if h is not None and h.deliver is not None:
            before[w][h.deliver].append(Action(FREE_WGRAD, s, peer=o))
    for s, w, o in sorted(last):  # the rest at the end, in the order the owner takes them in
        if (h := hand.get((s, w, o))) is None or h.post is None:
            before[o][len(tl.sequences[o])].append(Action(RECV_WGRAD, s, peer=w))
    return weave(progs, before, after)


def _partial_sums(tl: Timeline) -> dict[tuple[int, int, int], int]:
    """Per weight-gradient sum a worker computes for another owner, ``(stage, worker, owner)``, the
    last job of that worker that adds to it."""
    space = tl.schedule.space
    S, B, SB = space.S, space.microbatches, space.S * space.microbatches
    last: dict[tuple[int, int, int], int] = {}
    if _all_on_own_weights(tl):
        return last
    for w, prog in enumerate(tl.sequences):
        for j in prog:
            # B, or W when split: it yields the gradient (none for a frozen stage: nothing to send)
            if j // SB == space.K - 1 and tl.owner[j] != w and (j // B) % S not in tl.schedule.frozen:
                last[((j // B) % S, w, tl.owner[j])] = j
    return last


def add_reduces(tl: Timeline, progs: Programs, weight_cache: str) -> Programs:
    """Replicas: the owners of a replicated stage (DDP, LPP with G > 1) all-reduce its gradient on
    their own subgroup (a collective, not a message: :mod:`launcher.runtime.groups`) once their
    partial sums are in; then each owner steps its optimizer for the stages it owns.

    An owner's share is complete (``REDUCE``, :meth:`~launcher.schedule.program.Program.reduce_points`)
    after its last gradient job of the stage that it owns itself, at once if it computes nothing of
    it, or at the end of its program if others send it partial sums."""
    space = tl.schedule.space
    S, B, SB = space.S, space.microbatches, space.S * space.microbatches
    owners = stage_owners(tl)
    sums = {(o, s) for s, _, o in _partial_sums(tl)}  # owners that partial sums come in to, by stage
    before, after = _slots(tl)
    for w, prog in enumerate(tl.sequences):
        ready = {(j // B) % S: i for i, j in enumerate(prog) if j // SB == space.K - 1 and tl.owner[j] == w}
        for s in range(S):
            if len(owners[s]) > 1 and w in owners[s] and s not in tl.schedule.frozen:
                if (w, s) in sums:
                    before[w][len(prog)].append(Action(REDUCE, s))
                else:
                    after[w][ready.get(s, -1)].append(Action(REDUCE, s))
    return weave(progs, before, after)


#: the passes of :func:`lower_actions`, in order, after :func:`job_actions` (then :func:`post_early`)
PASSES = (add_act_grad, add_weights, add_wgrad, add_reduces)


def lower_actions(tl: Timeline, weight_cache: str = DEFAULT.weight_cache, prefetch: int = DEFAULT.prefetch) -> Programs:
    """Every worker's actions for ``tl``, as the workers run them: its jobs, what each pass of
    :data:`PASSES` adds, and the lookahead ``prefetch`` resolved (:func:`post_early`)."""
    check_options(weight_cache, prefetch)
    progs = job_actions(tl)
    for add in PASSES:
        progs = add(tl, progs, weight_cache)
    return _file_placed(tl, post_early(tl, progs, prefetch), progs)


def _file_placed(tl: Timeline, progs: Programs, latest: Programs) -> Programs:
    """``progs`` with the actions where a schedule file that places them puts them (torch's full
    CSV, or a whole step in our text: :func:`~launcher.schedule.order_file.file_placed`, checked
    against ``latest``, the same step without lookahead); ``progs`` itself otherwise."""
    try:
        return file_placed(tl.schedule.order, progs, latest)
    except ValueError as e:
        raise LoweringError(str(e)) from e


def lower(tl: Timeline, weight_cache: str = DEFAULT.weight_cache, prefetch: int = DEFAULT.prefetch) -> Lowered:
    """Lower ``tl`` into per-worker programs; identical on every worker.

    The same as :func:`assemble` of :func:`lower_actions`, without pairing the ``act`` and ``grad``
    actions again: the programs take those messages from :func:`edges` (a step has one per edge
    that crosses workers; the other passes add a few per stage).

    ``lowered.predicted`` is the simulator's :func:`~launcher.schedule.metrics.per_worker`, except
    ``weights_peak_resident`` under ``weight_cache="job"``: the exact peak of the engine running
    with lookahead ``prefetch`` (:func:`~launcher.schedule.program.resident_peaks`), which the
    simulator cannot know.
    """
    check_options(weight_cache, prefetch)
    with _collector_paused():
        found = edges(tl)
        progs = add_act_grad(tl, job_actions(tl), weight_cache, found)
        for add in PASSES:
            if add is not add_act_grad:
                progs = add(tl, progs, weight_cache)
        early = post_early(tl, progs, prefetch)
        placed = _file_placed(tl, early, progs)
        if placed is not early:  # the file's places, checked against the timeline: its messages read from it
            return assemble(tl, placed, weight_cache, prefetch)
        return assemble_with(tl, early, found, weight_cache, prefetch)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a step is lowered: lowering makes a few hundred
    thousand small containers and no reference cycles, and each collection the allocations set off
    walks them all again (as much time as the lowering itself on a 32,768-job step)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
