"""From per-worker action lists to the programs: every send paired with its receive, the messages
keyed and numbered in the order NCCL needs, each worker's :class:`~launcher.schedule.program.Program`
filled in.

Pure Python, no torch. :mod:`launcher.schedule.lowering` writes the action lists (its passes) and
calls :func:`assemble_with` with the ``act``/``grad`` messages it already knows;
:func:`assemble` reads everything from the lists, as parsed from text
(:func:`~launcher.schedule.actions.parse_programs`), and checks that they fit the timeline.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial
from itertools import accumulate, compress
from operator import attrgetter, itemgetter, sub
from textwrap import indent

from .actions import (
    AFTER,
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
    SENDS,
    Action,
    format_programs,
)
from .metrics import WEIGHT_CACHES, per_worker
from .program import (
    ACT,
    GRAD,
    WEIGHTS,
    WGRAD,
    JobOp,
    Lowered,
    Msg,
    Op,
    Program,
    reduce_rounds,
    resident_peaks,
    stage_reduces,
    tail_of,
)
from .settings import DEFAULT
from .simulate import Timeline

#: point-to-point tags are C ints: a message's tag is its id, the engine's own exchanges follow
TAG_LIMIT = 2**31 - 1


class LoweringError(ValueError):
    """A timeline the runtime cannot lower."""


Programs = list[list[Action]]  # one action list per worker
OP = itemgetter(0)  # an action's ``op`` (a found message's numbering order)
_KEY = attrgetter("key")  # a message's sort key

#: columns of the grid an error message shows on each side of the marked action
AROUND = 8


def marked_error(progs: Programs, mark: tuple[int, int] | None, what: str, why: str = "") -> LoweringError:
    """A :class:`LoweringError`: ``what``, the grid of ``progs`` with the action at ``mark`` marked, then ``why``."""
    jobs_only = all(a.op in JOBS for prog in progs for a in prog)
    grid = indent(format_programs(progs, mark, AROUND, align=jobs_only), "  ")
    return LoweringError(f"{what}{' (marked below)' if mark else ''}:\n{grid}" + (f"\n{why}" if why else ""))


def check_options(weight_cache: str, prefetch: int | None = None) -> None:
    if weight_cache not in WEIGHT_CACHES:
        raise LoweringError(f"weight_cache={weight_cache!r} is not valid; choose one of {list(WEIGHT_CACHES)}")
    if prefetch is not None and not (isinstance(prefetch, int) and prefetch >= 0):
        raise LoweringError(f"prefetch={prefetch!r} is not valid; it must be an int >= 0 (jobs of lookahead)")


def stage_owners(tl: Timeline) -> list[list[int]]:
    """Per stage, its owners (the ``w_owner`` of its jobs), sorted."""
    space = tl.schedule.space
    S, B = space.S, space.microbatches
    owners: list[set[int]] = [set() for _ in range(S)]
    for q in range(space.K * S):  # the jobs of one (kind, stage) are a run of B ids
        owners[q % S].update(tl.owner[q * B : (q + 1) * B])
    return [sorted(o) for o in owners]


def timeline_jobs(tl: Timeline) -> Programs:
    """Each worker's jobs in timeline order, as actions."""
    space = tl.schedule.space
    S, B, kinds = space.S, space.microbatches, space.kinds
    acts = [Action(kinds[k], s, b) for k in range(space.K) for s in range(S) for b in range(B)]  # by job id
    return [[acts[j] for j in prog] for prog in tl.sequences]

#: one ``act`` or ``grad`` message along an edge of the job graph, as :func:`edges` gives it:
#: (numbering order, key, kind, src, dst, stage, microbatch, peer_stage, the producer's index among
#: ``src``'s jobs, the consumer's among ``dst``'s), the first eight as in :class:`Msg` (a plain tuple:
#: a step has one per edge that crosses workers, tens of thousands)
Edge = tuple[int, tuple, str, int, int, int, int, int, int, int]



# each receive's send and message kind; a free of a partial sum names it as its send does
_RECEIVES: dict[str, tuple[str, str] | None] = {
    RECV_ACT: (SEND_ACT, ACT), RECV_GRAD: (SEND_GRAD, GRAD), RECV_WEIGHTS: (SEND_WEIGHTS, WEIGHTS),
    RECV_WGRAD: (SEND_WGRAD, WGRAD), FREE_WGRAD: None}
_WEIGHT_SENDS = frozenset((SEND_WEIGHTS, SEND_WGRAD))  # the sends and receives left once the edges are known
_WEIGHT_RECEIVES = frozenset((RECV_WEIGHTS, RECV_WGRAD, FREE_WGRAD))
_AFTER = frozenset(AFTER)
# kinds about the job beside them -> the job kinds that may be (a gradient sum goes after B or W)
_OF_JOB = {SEND_ACT: "F", RECV_ACT: "F", SEND_GRAD: "BI", RECV_GRAD: "BI", RECV_WEIGHTS: "FBIW",
           FREE_WEIGHTS: "FBIW", SEND_WGRAD: "BW"}
_AT_END = frozenset((SEND_WEIGHTS, RECV_WGRAD, REDUCE))  # what may follow a worker's last job's own actions
_EDGE = frozenset((SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD))  # messages along an edge of one micro-batch
_JOB_OR_EDGE = JOBS | _EDGE


def _belongs(prog: list[Action]) -> list[int]:
    """Per action, the index of the job it belongs to (:mod:`launcher.schedule.actions`): -1
    before the first job, the job count after the last."""
    ops = list(map(OP, prog))
    jobs_before = accumulate(map(JOBS.__contains__, ops), initial=0)  # at each action, the jobs before it
    return list(map(sub, jobs_before, map(_AFTER.__contains__, ops)))


def _bound(prog: list[Action], belongs: list[int], owner: list[int], w: int) -> list[int]:
    """``belongs`` with each receive of :data:`~launcher.schedule.actions.POSTED` bound to the job
    it feeds, the first after it of its stage and micro-batch that takes it: ``RECV_ACT`` a
    forward, ``RECV_GRAD`` a backward (``B`` or ``I``), ``RECV_WEIGHTS`` a job on another worker's
    weights (``owner``: per job, its ``w_owner``), one copy per job, in order. A receive that
    feeds no job is bound past the last job (:func:`_check_actions` refuses it)."""
    if not any(a.op in POSTED for a in prog):
        return belongs
    out = list(belongs)
    pending: dict[tuple[str, int, int], list[int]] = {}
    i = 0
    for n, a in enumerate(prog):
        op = a.op
        if op in POSTED:
            pending.setdefault((op, a.stage, a.microbatch), []).append(n)
        elif op in JOBS:
            key = (RECV_ACT if op == "F" else RECV_GRAD, a.stage, a.microbatch)
            for k in pending.pop(key, ()) if op != "W" else ():
                out[k] = i
            copies = pending.get((RECV_WEIGHTS, a.stage, a.microbatch)) if i >= len(owner) or owner[i] != w else None
            if copies:
                out[copies.pop(0)] = i
            i += 1
    for left in pending.values():
        for k in left:
            out[k] = i
    return out


def _check_actions(tl: Timeline, progs: Programs, belongs: list[list[int]]) -> None:
    """Each worker runs the timeline's jobs in its order; an action about a job of its own sits
    beside one of that stage (and micro-batch); a message goes to another worker."""
    S, W, owners = tl.schedule.space.S, tl.schedule.workers, stage_owners(tl)
    if len(progs) != W:
        raise LoweringError(f"the step has {W} workers but {len(progs)} programs")
    for w, (prog, want) in enumerate(zip(progs, timeline_jobs(tl))):
        jobs = [n for n, a in enumerate(prog) if a.op in JOBS]
        if [prog[n] for n in jobs] != want:
            k = next((k for k, (n, a) in enumerate(zip(jobs, want)) if prog[n] != a), min(len(jobs), len(want)))
            raise marked_error(progs, (w, jobs[k]) if k < len(jobs) else None,
                          f"worker {w} does not run the timeline's jobs: its job {k} should be "
                          f"{repr(want[k]) if k < len(want) else 'none'}")
        for n, (a, i) in enumerate(zip(prog, belongs[w])):
            if a.op in JOBS:
                continue
            job = want[i] if 0 <= i < len(want) else None
            if not 0 <= a.stage < S:
                fits = False
            elif job is None:  # before the first job or after the last
                fits = a.op == REDUCE if i < 0 else a.op in _AT_END
            else:
                fits = a.op not in _OF_JOB or job.op in _OF_JOB[a.op] and a.stage == job.stage and \
                    a.microbatch in ((job.microbatch,) if a.op in _EDGE else (job.microbatch, -1))
            if not fits or a.op == REDUCE and (w not in owners[a.stage] or len(owners[a.stage]) < 2):
                raise marked_error(progs, (w, n), f"worker {w}'s {a!r} does not sit beside a job it belongs to",
                              "an action belongs to the job before it (sends, frees, REDUCE) or the one after it "
                              "(the rest); one about a job needs a job of its kind, stage and micro-batch; REDUCE "
                              "needs a replicated stage the worker owns")
            if (a.op in SENDS or a.op in _RECEIVES) and not (0 <= a.peer < W and a.peer != w):
                raise marked_error(progs, (w, n), f"worker {w}'s {a!r} names worker {a.peer}, not another of the {W}")


def messages(tl: Timeline, progs: Programs, belongs: list[list[int]], edge_msgs: list[Edge] | None = None) \
        -> tuple[list[Msg], list[list[int]], list[Edge]]:
    """Every message of the step, per worker each weight kind's action's message id (-1: none or
    ``act``/``grad``), and the ``act``/``grad`` messages as :func:`edges` gives them (whose ids are
    their places in that list). ``edge_msgs``: those, already known (:func:`lower`); else they are
    read from ``progs`` too.

    A send and a receive match when kind, workers, stages and micro-batch agree (the k-th send with
    the k-th receive). Message ids: ``act``/``grad`` by consuming job, then ``weights`` by worker
    and job, then ``wgrad`` by stage, sender and owner.

    Message order, for NCCL: NCCL ignores tags, matches point-to-point operations between a pair of
    ranks in issue order, and runs a pair's operations (both directions) one after another. So every
    message gets a sort ``key``: the simulated time at which its data is ready at the sender
    (``act``/``grad``: the producing job's finish; ``wgrad``: the finish of the last job whose
    gradient it sums; ``weights``: the consuming job's start, since owners hold weights all step). An
    owner hands a weights message over just before its first job that starts at or after that key
    (:func:`~launcher.schedule.lowering.add_weights`). Both ends issue a pair's operations in key order. A worker only
    ever waits for data whose key is earlier than the simulated start of the job that waits, so
    issuing in key order cannot deadlock (the simulated timeline is a witness).
    """
    space, seqs, start, finish = tl.schedule.space, tl.sequences, tl.start, tl.finish
    S, B, N, W = space.S, space.microbatches, space.N, len(progs)
    # the producer's place among the consumer's predecessors (JobSpace.pred), from the stage graph:
    # act by the consumer's stage, grad by the producing backward's
    act_place = [{p: k for k, p in enumerate(ps)} for ps in space.stage_preds]
    grad_place = [{c: k for k, c in enumerate(cs)} for cs in space.stage_succs]
    base_weights = 2 * N * S  # numbering order as one int: act/grad by consumer job and place, then ...
    base_wgrad = base_weights + W * (N + 1)  # ... weights by worker and job, then wgrad by stage, sender, owner
    sends, receives = (SENDS, _RECEIVES) if edge_msgs is None else (_WEIGHT_SENDS, _WEIGHT_RECEIVES)
    # each worker's sends by action (the k-th send of an action matches the k-th receive of its mirror)
    sent: list[dict[tuple, list[int]]] = []
    for prog in progs:
        is_send = list(map(sends.__contains__, map(OP, prog)))
        at: dict = dict(zip(compress(prog, is_send), compress(range(len(prog)), is_send)))
        if len(at) < sum(is_send):  # the same send twice (a stage fetched for two jobs): in order
            at = {}
            for n in compress(range(len(prog)), is_send):
                at.setdefault(prog[n], []).append(n)
        sent.append(at)
    # (numbering order, key, kind, src, dst, stage, microbatch, peer_stage, sender's action, receiver's)
    found: list[Edge] = []
    edge_found: list[Edge] = []
    frees: list[tuple[int, int]] = []
    for wr, prog in enumerate(progs):
        for nr in compress(range(len(prog)), map(receives.__contains__, map(OP, prog))):  # receives and frees
            op, stage, mb, ws, peer_stage = prog[nr]
            if (how := _RECEIVES[op]) is None:
                frees.append((wr, nr))
                continue
            send_op, kind = how
            # the send this receive mirrors: the same message seen from the sender's side
            if kind == ACT or kind == GRAD:
                mirror = (send_op, peer_stage, mb, wr, stage)
                x, y = (peer_stage, stage) if kind == ACT else (stage, peer_stage)  # ``stage`` produces the edge
            else:
                mirror = (send_op, stage, mb, wr, peer_stage)
                x = y = stage
            at = sent[ws] if 0 <= ws < len(sent) else {}
            ns = at.pop(mirror, None)
            if isinstance(ns, list):  # duplicates: the first left, then the rest
                at[mirror] = ns
                ns = ns.pop(0) if ns else None
            if ns is None:
                raise marked_error(progs, (wr, nr),
                                   f"worker {wr}'s {progs[wr][nr]!r} has no matching send on worker {ws}")
            if kind == ACT or kind == GRAD:  # the jobs at both ends are the edge's (they sit beside them)
                if kind == ACT:
                    producer, consumer, k = x * B + mb, y * B + mb, act_place[y].get(x)
                else:
                    producer, consumer, k = (S + y) * B + mb, (S + x) * B + mb, grad_place[x].get(y)
                if k is None:
                    raise marked_error(progs, (wr, nr), f"worker {wr}'s {progs[wr][nr]!r} carries no edge of the stage "
                                  "graph")
                edge_found.append((consumer * S + k, (finish[producer], 0, producer, consumer), kind, ws, wr, x, mb, y,
                                   belongs[ws][ns], belongs[wr][nr]))
            elif kind == WEIGHTS:  # ready when its consumer starts: owners hold weights all step
                i = belongs[wr][nr]
                consumer = seqs[wr][i]
                found.append((base_weights + wr * (N + 1) + i, (start[consumer], -1, consumer, consumer), kind, ws, wr,
                              x, -1, y, ns, nr))
            else:  # ready when the last job it sums ends
                producer = seqs[ws][belongs[ws][ns]]
                found.append((base_wgrad + (stage * W + ws) * W + wr, (finish[producer], 1, producer, wr), kind, ws, wr,
                              x, -1, y, ns, nr))
    for w, at in enumerate(sent):
        left = [n for v in at.values() for n in (v if isinstance(v, list) else (v,))]
        if left:
            n = min(left)
            raise marked_error(progs, (w, n), f"worker {w}'s {progs[w][n]!r} has no matching receive on worker "
                          f"{progs[w][n].peer}")
    if edge_msgs is None:
        edge_found.sort(key=OP)
        edge_msgs = edge_found
    found.sort(key=OP)
    msgs = _as_msgs(edge_msgs, 0)
    mids = [[-1] * len(prog) for prog in progs]
    for mid, (_, _, _, ws, wr, _, _, _, ns, nr) in enumerate(found, len(msgs)):
        mids[ws][ns] = mids[wr][nr] = mid
    msgs += _as_msgs(found, len(msgs))
    wgrad = {(m.src, m.dst, m.stage): m.mid for m in msgs if m.kind == WGRAD}
    for w, n in frees:
        a = progs[w][n]
        if (w, a.peer, a.stage) not in wgrad:
            raise marked_error(progs, (w, n), f"worker {w} frees a sum {a!r} it never sends")
        mids[w][n] = wgrad[(w, a.peer, a.stage)]
    return msgs, mids, edge_msgs


def _as_msgs(found: list[Edge], first: int) -> list[Msg]:
    """The messages ``found`` as :class:`Msg`, numbered from ``first`` (column by column: tens of
    thousands of tuples made without a Python call each)."""
    if not found:
        return []
    _, key, kind, src, dst, stage, mb, peer, _, _ = zip(*found)
    return list(map(_NEW_MSG, zip(range(first, first + len(found)), kind, src, dst, stage, mb, peer, key)))


_NEW_MSG = partial(tuple.__new__, Msg)  # a Msg from its fields' tuple



def assemble(tl: Timeline, progs: Programs, weight_cache: str = DEFAULT.weight_cache, prefetch: int = DEFAULT.prefetch,
             check: bool = True) -> Lowered:
    """The :class:`~launcher.schedule.program.Lowered` step that the per-worker actions ``progs``
    describe (:func:`lower_actions`, or what :func:`~launcher.schedule.actions.parse_programs`
    reads back): messages paired, keyed and numbered (:func:`messages`), each worker's
    :class:`~launcher.schedule.program.Program` filled in. With ``check``, an action that does not
    fit ``tl`` raises :class:`LoweringError` with the grid, that action marked (the passes' own
    programs fit by construction)."""
    check_options(weight_cache, prefetch)
    if check:
        if len(progs) != tl.schedule.workers:
            raise LoweringError(f"the step has {tl.schedule.workers} workers but {len(progs)} programs")
        _check_actions(tl, progs, _bindings(tl, progs))
    return assemble_with(tl, progs, None, weight_cache, prefetch)


def _bindings(tl: Timeline, progs: Programs) -> list[list[int]]:
    """Per worker and action, the job it belongs to (:func:`_belongs`), a receive's the job it feeds
    (:func:`_bound`)."""
    owner = tl.owner
    return [_bound(prog, _belongs(prog), [owner[j] for j in tl.sequences[w]] if w < len(tl.sequences) else [], w)
            for w, prog in enumerate(progs)]


def assemble_with(tl: Timeline, progs: Programs, edge_msgs: list[Edge] | None, weight_cache: str,
              prefetch: int) -> Lowered:
    """:func:`assemble`, the ``act``/``grad`` messages given (:func:`edges`) or read from ``progs``."""
    S, W = tl.schedule.space.S, tl.schedule.workers
    belongs = _bindings(tl, progs)
    msgs, mids, edge_msgs = messages(tl, progs, belongs, edge_msgs)
    if len(msgs) + 2 * S + S * reduce_rounds(W) > TAG_LIMIT:  # the step's tags, then the engine's ranges
        raise LoweringError(
            f"the step has {len(msgs):,} messages and {S} stages, more than the {TAG_LIMIT:,} point-to-point "
            f"message tags torch.distributed can tell apart; use fewer stages or micro-batches"
        )
    owners = stage_owners(tl)
    between: defaultdict[tuple[int, int], list[int]] = defaultdict(list)  # a pair's messages, both ways
    for m in sorted(msgs, key=_KEY):
        between[(m.src, m.dst) if m.src < m.dst else (m.dst, m.src)].append(m.mid)
    pair: list[dict[int, list[int]]] = [{} for _ in range(W)]
    for (a, b), mids_ab in between.items():  # each worker's peers in the order of their first message
        pair[a][b], pair[b][a] = mids_ab, list(mids_ab)
    owner, start = tl.owner, tl.start
    seqs = tl.sequences
    jobs = [[JobOp(j, stage, mb, op, owner[j], {}, None, False, start[j])
             for j, (op, stage, mb, _, _) in zip(seqs[w], compress(prog, map(JOBS.__contains__, map(OP, prog))))]
            for w, prog in enumerate(progs)]
    sends: list[defaultdict[int, list[int]]] = [defaultdict(list) for _ in range(W)]  # per job index: its sends
    for mid, (_, _, kind, ws, wr, stage, _, peer, ns, nr) in enumerate(edge_msgs):  # each job's messages in id order
        jobs[wr][nr].recv[stage if kind == ACT else peer] = mid
        sends[ws][ns].append(mid)
    programs = [_program(w, progs[w], jobs[w], sends[w], belongs[w], mids[w], msgs, owners, pair[w],
                         tl.schedule.frozen) for w in range(W)]
    lowered = Lowered(tl, weight_cache, msgs, programs, owners, per_worker(tl, weight_cache), prefetch,
                      _reduce_order(tl, programs, owners))
    if weight_cache == "job":
        owned = lowered.predicted["weights_owned"]
        lowered.predicted["weights_peak_resident"] = [o + r for o, r in zip(owned, resident_peaks(lowered, prefetch))]
    return lowered


def _program(w: int, prog: list[Action], jobs: list[JobOp], sends: dict[int, list[int]], bound: list[int],
             mids: list[int], msgs: list[Msg], owners: list[list[int]], pair: dict[int, list[int]],
             frozen: frozenset[int] = frozenset()) -> Program:
    """Worker ``w``'s :class:`~launcher.schedule.program.Program` from its actions (``bound``: per
    action, the job it belongs to, a receive's the job it feeds; ``mids``: per action, its
    message's id, -1: none or ``act``/``grad``) and its jobs, their activations and gradients filled
    in (``sends``: per job index, the ``act``/``grad`` messages it sends): its operations are the
    actions one for one. A stage in ``frozen`` (nothing to train) has no all-reduce."""
    held: dict[int, int] = {}  # stage -> the fetched copy its jobs here run on
    copy_for: dict[int, int] = {}  # job index -> the copy received for it
    ops: list[Op] = []
    for n, a in enumerate(prog):
        kind, i = a.op, bound[n]
        if kind in JOBS:
            job = jobs[i]
            if i in copy_for:
                held[a.stage] = copy_for.pop(i)
            if job.owner != w:
                job.weights_mid = held.get(a.stage)
            ops.append((kind, i))
        elif kind == FREE_WEIGHTS:  # done by the job itself, as it ends
            jobs[i].free_weights = True
            held.pop(a.stage, None)
        elif kind == RECV_ACT or kind == RECV_GRAD:
            ops.append((kind, jobs[i].recv[a.peer_stage]))
        elif kind == SEND_ACT or kind == SEND_GRAD:  # which of the job's outputs: by receiver and its stage
            ops.append((kind, next(mid for mid in sends[i] if msgs[mid].dst == a.peer and
                                   (msgs[mid].peer_stage if kind == SEND_ACT else msgs[mid].stage) == a.peer_stage)))
        elif kind == REDUCE:
            ops.append((kind, a.stage))
        else:
            mid = mids[n]
            ops.append((kind, mid))
            if kind == RECV_WEIGHTS:
                copy_for[i] = mid
    return Program(w, jobs, stage_reduces(w, ops, msgs, owners, frozen), [s for s, o in enumerate(owners) if w in o],
                   pair, ops, tail_of(ops))


def _reduce_order(tl: Timeline, programs: list[Program], owners: list[list[int]]) -> list[int]:
    """Replicated stages in the one order every owner launches their all-reduces in: by when the
    last owner's share is complete on the simulated timeline (then owner set, stage)."""
    ready_time: dict[int, float] = {}
    for prog in programs:
        for s, i in prog.reduce_points().items():
            t = tl.finish[prog.jobs[i].job] if 0 <= i < len(prog.jobs) else (0.0 if i < 0 else tl.latency)
            ready_time[s] = max(ready_time.get(s, 0.0), t)
    return sorted(ready_time, key=lambda s: (ready_time[s], tuple(owners[s]), s))
