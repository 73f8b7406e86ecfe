"""Lower a simulated :class:`~launcher.schedule.Timeline` into one program per worker.

Pure Python, no torch. Every worker calls :func:`lower` on the same timeline and gets the same
:class:`Lowered`, so every send has its matching receive without a coordinator.

What the placement implies (docs/design.md, "Placement and data movement") is lowered by passes
over one list of :class:`~launcher.runtime.actions.Action` per worker, each pass documenting the
traffic it adds: the jobs in timeline order (:func:`job_actions`), then :data:`PASSES`: ``act``
and ``grad`` messages (:func:`add_act_grad`), ``weights`` under the weight cache policy
(:func:`add_weights`), ``wgrad`` (:func:`add_wgrad`), the replicas' all-reduces
(:func:`add_reduces`). :func:`assemble` then pairs every send with its receive, keys and
numbers the messages in the order NCCL needs (:func:`messages`) and fills each worker's
:class:`Program`. :func:`lower_actions` gives the lists themselves:
:func:`~launcher.runtime.actions.format_programs` prints them, one line per worker, and
:func:`assemble` of what :func:`~launcher.runtime.actions.parse_programs` reads back is the
same plan.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from textwrap import indent
from typing import Iterable

from launcher.schedule.activations import sum_handovers
from launcher.schedule.metrics import WEIGHT_CACHES, per_worker
from launcher.schedule.simulate import Timeline

from .actions import (
    AFTER,
    FREE_WEIGHTS,
    FREE_WGRAD,
    JOBS,
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
    format_programs,
    weave,
)

ACT, GRAD, WEIGHTS, WGRAD = "act", "grad", "weights", "wgrad"
KINDS = (ACT, GRAD, WEIGHTS, WGRAD)


#: point-to-point tags are C ints: a message's tag is its id, the engine's own exchanges follow
TAG_LIMIT = 2**31 - 1


def reduce_rounds(n: int) -> int:
    """Message rounds of one all-reduce among at most ``n`` workers by recursive halving and
    doubling (:mod:`launcher.runtime.collectives`): ``2 log2(p)`` for the largest power of two
    ``p <= n``, plus 2 to fold in the rest."""
    return 2 * max(n.bit_length() - 1, 0) + 2


class LoweringError(ValueError):
    """A timeline the runtime cannot lower."""


@dataclass(frozen=True)
class Msg:
    """One point-to-point message of the step.

    ``stage``: the stage whose tensor it carries (``act``/``grad``: the producing stage ``p`` of
    the edge ``p -> peer_stage``; weight kinds: the stage). ``microbatch`` is -1 for weight kinds.
    """

    mid: int
    kind: str
    src: int
    dst: int
    stage: int
    microbatch: int
    peer_stage: int
    key: tuple


@dataclass
class JobOp:
    """A compute job with the messages it consumes and produces."""

    job: int
    stage: int
    microbatch: int
    kind: str
    owner: int  # w_weights of this job
    recv: dict[int, int] = field(default_factory=dict)  # pred stage (F) or succ stage (B/I) -> mid
    send: list[int] = field(default_factory=list)  # mids this job's output feeds
    wgrad_send: list[int] = field(default_factory=list)  # weight-gradient sums complete after this job
    weights: int | None = None  # weights message this job runs on (None: owned stage)
    free_weights: bool = False  # drop the fetched copy when the job ends (cache "job")
    start: float = 0.0  # simulated start, for reports


@dataclass
class StageReduce:
    """The gradient traffic of one stage on one worker."""

    stage: int
    send_to_owner: dict[int, int] = field(default_factory=dict)  # owner -> wgrad mid (sent after a job)
    recv_from: list[int] = field(default_factory=list)  # wgrad mids into this owner
    replicas: tuple[int, ...] = ()  # the owners that all-reduce this stage (empty: one owner)


@dataclass
class Program:
    """Everything one worker does in a step, in order."""

    worker: int
    jobs: list[JobOp]
    reduces: list[StageReduce]
    owned: list[int]  # stages this worker is a source of truth for
    pair_order: dict[int, list[int]]  # peer -> mids to or from that peer, in issue order
    # job index -> weights this owner hands over before that job (index len(jobs): at the end);
    # just in time, so a consumer is never made to post a receive for weights it needs much later
    weight_release: dict[int, list[int]] = field(default_factory=dict)
    # replicated stage this worker owns -> index of the job after which its own share of the
    # stage's gradient is complete (len(jobs): at the end, when partial sums come in from others;
    # -1: at once, when it computes nothing of the stage)
    reduce_ready: dict[int, int] = field(default_factory=dict)
    # cache "job": job index -> partial sums of a stage this worker alone owns that it receives
    # before that job and adds into its total after it, instead of all at the end of the step ...
    wgrad_post: dict[int, list[int]] = field(default_factory=dict)
    # ... and job index -> partial sums this worker sent that are received by then (the owner's
    # job that takes them in started earlier on the timeline): it waits for their delivery and
    # frees them, so no worker holds every fetched stage's sum to the end of the step
    wgrad_deliver: dict[int, list[int]] = field(default_factory=dict)


@dataclass
class Lowered:
    """The step lowered for every worker, plus the counts the simulator predicts."""

    timeline: Timeline
    weight_cache: str
    messages: list[Msg]
    programs: list[Program]
    owners: list[list[int]]  # stage -> sorted owner workers
    predicted: dict[str, list]
    prefetch: int = 1  # the engine's lookahead (jobs) that ``predicted["weights_peak_resident"]`` is for
    # replicated stages in the one order every owner launches their all-reduces in: by when the
    # last owner's share is complete on the simulated timeline (then owner set, stage)
    reduce_order: list[int] = field(default_factory=list)

    @property
    def workers(self) -> int:
        return len(self.programs)

    @property
    def tag_base(self) -> int:
        """The first message tag after the step's own (each message's tag is its id): the
        engine's exchanges outside the step (replica sync, gather_state) start here, so no step
        size can make their tags collide with the step's."""
        return len(self.messages)

    def reduce_tag(self, bucket: int, round_: int) -> int:
        """The tag of round ``round_`` of the ``bucket``-th all-reduce of the step (its place in
        :attr:`reduce_order`'s buckets), after the step's messages and the two per-stage ranges."""
        return self.tag_base + 2 * self.timeline.step.space.S + bucket * reduce_rounds(self.workers) + round_

    def counts(self) -> dict[str, list[int]]:
        """Messages received per worker and kind, straight from the plan."""
        out = {k: [0] * self.workers for k in KINDS}
        for m in self.messages:
            out[m.kind][m.dst] += 1
        return out


Programs = list[list[Action]]  # one action list per worker
Slots = list[dict[int, list[Action]]]  # per worker, job index -> actions to weave in beside that job

#: columns of the grid an error message shows on each side of the marked action
AROUND = 8


def _marked(progs: Programs, mark: tuple[int, int] | None, what: str, why: str = "") -> LoweringError:
    """A :class:`LoweringError`: ``what``, the grid of ``progs`` with the action at ``mark`` marked, then ``why``."""
    jobs_only = all(a.op in JOBS for prog in progs for a in prog)
    grid = indent(format_programs(progs, mark, AROUND, align=jobs_only), "  ")
    return LoweringError(f"{what}{' (marked below)' if mark else ''}:\n{grid}" + (f"\n{why}" if why else ""))


def _check_options(weight_cache: str, prefetch: int | None = None) -> None:
    if weight_cache not in WEIGHT_CACHES:
        raise LoweringError(f"weight_cache={weight_cache!r} is not valid; choose one of {list(WEIGHT_CACHES)}")
    if prefetch is not None and not (isinstance(prefetch, int) and prefetch >= 0):
        raise LoweringError(f"prefetch={prefetch!r} is not valid; it must be an int >= 0 (jobs of lookahead)")


def _slots(tl: Timeline) -> tuple[Slots, Slots]:
    return [{} for _ in tl.program], [{} for _ in tl.program]


def _positions(tl: Timeline) -> list[int]:
    """Each job's index in its worker's program."""
    at = [0] * tl.step.space.N
    for prog in tl.program:
        for i, j in enumerate(prog):
            at[j] = i
    return at


def _owners(tl: Timeline) -> list[list[int]]:
    """Per stage, its owners (the ``w_weights`` of its jobs), sorted."""
    space = tl.step.space
    owners: list[set[int]] = [set() for _ in range(space.S)]
    for j in range(space.N):
        owners[(j // space.B) % space.S].add(tl.weights[j])
    return [sorted(o) for o in owners]


def _jobs(tl: Timeline) -> Programs:
    """Each worker's jobs in timeline order, as actions."""
    space = tl.step.space
    S, B, SB, kinds = space.S, space.B, space.S * space.B, space.kinds
    return [[Action(kinds[j // SB], (j // B) % S, j % B) for j in prog] for prog in tl.program]


def job_actions(tl: Timeline) -> Programs:
    """Each worker's jobs in timeline order. Every job of ``(s, b)`` must run where ``F(s, b)``
    ran: its activation stash lives there."""
    space, progs = tl.step.space, _jobs(tl)
    SB = space.S * space.B
    for j in range(SB, space.N):
        if tl.compute[j] != tl.compute[j % SB]:
            s, b, d = space.job(j)
            w = tl.compute[j]
            raise _marked(progs, (w, tl.program[w].index(j)),
                          f"placement {tl.step.name} runs F({s},{b}) on worker {tl.compute[j % SB]} but "
                          f"{d}({s},{b}) on worker {w}", "the runtime needs every job of a (stage, micro-batch) "
                          "on the worker that holds its activations")
    return progs


def add_act_grad(tl: Timeline, progs: Programs, weight_cache: str) -> Programs:
    """One message per edge of the job graph that crosses workers, sent after the job that
    produces it and received before the job that consumes it:

    - ``act``: ``F(p,b) -> F(c,b)`` across workers carries ``x_c^b`` (the output of stage ``p``);
    - ``grad``: backward ``(c,b) -> (p,b)`` across workers carries ``dL/d(output of p)``.
    """
    space, comp = tl.step.space, tl.compute
    S, B, SB = space.S, space.B, space.S * space.B
    at = _positions(tl)
    before, after = _slots(tl)
    for j in range(SB * 2):
        k, s = divmod(j // B, S)
        for p in space.pred(j):
            if comp[p] == comp[j] or p // SB != k:  # local, or the loss stage's F -> B
                continue
            ps, b = (p // B) % S, j % B
            send, recv = (SEND_ACT, RECV_ACT) if k == 0 else (SEND_GRAD, RECV_GRAD)
            after[comp[p]].setdefault(at[p], []).append(Action(send, ps, b, comp[j], s))
            before[comp[j]].setdefault(at[j], []).append(Action(recv, s, b, comp[p], ps))
    return weave(progs, before, after)


def add_weights(tl: Timeline, progs: Programs, weight_cache: str) -> Programs:
    """``weights``: a job with ``w_compute != w_weights`` runs on a copy of stage ``s`` sent by the
    owner ``w_weights``. With ``weight_cache="step"`` a worker fetches each stage once, for the
    first job that needs it, and keeps it to the end of the step; with ``"job"`` every such job
    fetches its own copy and frees it when it finishes, except that a backward whose forward ran on
    this worker's own weights backpropagates through that forward's graph (no copy), and a ``W``
    takes its gradient from its ``I``'s graph, on the copy ``I`` kept until then (no copy either).

    An owner hands a copy over just before its first job that starts at or after the consuming
    job's start (owners hold weights all step): just in time, so a consumer is never made to post a
    receive for weights it needs much later (``Program.weight_release``)."""
    space = tl.step.space
    SB = space.S * space.B
    before, after = _slots(tl)
    starts = [[tl.start[j] for j in prog] for prog in tl.program]
    hand: list[tuple[int, int, float, int, Action]] = []  # (owner, its job index, consumer's start, consumer, send)
    for w, prog in enumerate(tl.program):
        cached: set[int] = set()
        for i, j in enumerate(prog):
            s, _, d = space.job(j)
            o = tl.weights[j]
            if o == w or (weight_cache == "step" and s in cached):
                continue
            if weight_cache == "job":
                if d == "W" or (d != "F" and tl.weights[j % SB] == w):
                    continue  # reuses the graph (and copy) of F or I: no transfer
                after[w].setdefault(i, []).append(Action(FREE_WEIGHTS, s))
            cached.add(s)
            before[w].setdefault(i, []).append(Action(RECV_WEIGHTS, s, peer=o))
            hand.append((o, bisect_left(starts[o], tl.start[j]), tl.start[j], j, Action(SEND_WEIGHTS, s, peer=w)))
    for o, i, *_, send in sorted(hand, key=lambda h: h[:4]):  # in key order at each release point
        before[o].setdefault(i, []).append(send)
    return weave(progs, before, after)


def add_wgrad(tl: Timeline, progs: Programs, weight_cache: str) -> Programs:
    """``wgrad``: each worker sends its weight-gradient sum of a stage to every other owner it
    computed for (one message per ``(stage, owner)``) as soon as its last backward of that stage
    for that owner ends, so the transfer overlaps the rest of its backward.

    The owner takes the sums in at the end of the step, by stage and sender; under
    ``weight_cache="job"`` a stage's only owner takes each in at one of its jobs, and the sender
    frees it once delivered (:func:`~launcher.schedule.activations.sum_handovers`), so no worker holds
    every fetched stage's sum to the end of the step."""
    space = tl.step.space
    S, B, SB = space.S, space.B, space.S * space.B
    last: dict[tuple[int, int, int], int] = {}  # (stage, worker, owner) -> its last gradient job
    for w, prog in enumerate(tl.program):
        for j in prog:
            if j // SB == space.K - 1 and tl.weights[j] != w:  # B, or W when split: it yields the gradient
                last[((j // B) % S, w, tl.weights[j])] = j
    hand = {(h.stage, h.sender, h.owner): h for h in sum_handovers(tl)} if weight_cache == "job" else {}
    at = _positions(tl)
    before, after = _slots(tl)
    for (s, w, o), j in sorted(last.items(), key=lambda kv: (tl.finish[kv[1]], kv[1], kv[0][2])):  # in key order
        after[w].setdefault(at[j], []).append(Action(SEND_WGRAD, s, peer=o))
        h = hand.get((s, w, o))
        if h is not None and h.post is not None:
            before[o].setdefault(h.post, []).append(Action(RECV_WGRAD, s, peer=w))
        if h is not None and h.deliver is not None:
            before[w].setdefault(h.deliver, []).append(Action(FREE_WGRAD, s, peer=o))
    for s, w, o in sorted(last):  # the rest at the end, in the order the owner takes them in
        if (h := hand.get((s, w, o))) is None or h.post is None:
            before[o].setdefault(len(tl.program[o]), []).append(Action(RECV_WGRAD, s, peer=w))
    return weave(progs, before, after)


def add_reduces(tl: Timeline, progs: Programs, weight_cache: str) -> Programs:
    """Replicas: the owners of a replicated stage (DDP, LPP with G > 1) all-reduce its gradient on
    their own subgroup (a collective, not a message: :mod:`launcher.runtime.groups`) once their
    partial sums are in; then each owner steps its optimizer for the stages it owns.

    An owner's share is complete (``REDUCE``, ``Program.reduce_ready``) after its last gradient job
    of the stage that it owns itself, at once if it computes nothing of it, or at the end of its
    program if others send it partial sums."""
    space = tl.step.space
    S, B, SB = space.S, space.B, space.S * space.B
    owners = _owners(tl)
    sums = {(w, a.stage) for w, prog in enumerate(progs) for a in prog if a.op == RECV_WGRAD}
    before, after = _slots(tl)
    for w, prog in enumerate(tl.program):
        ready = {(j // B) % S: i for i, j in enumerate(prog) if j // SB == space.K - 1 and tl.weights[j] == w}
        for s in range(S):
            if len(owners[s]) > 1 and w in owners[s]:
                if (w, s) in sums:
                    before[w].setdefault(len(prog), []).append(Action(REDUCE, s))
                else:
                    after[w].setdefault(ready.get(s, -1), []).append(Action(REDUCE, s))
    return weave(progs, before, after)


#: the passes of :func:`lower_actions`, in order, after :func:`job_actions`
PASSES = (add_act_grad, add_weights, add_wgrad, add_reduces)


def lower_actions(tl: Timeline, weight_cache: str = "step") -> Programs:
    """Every worker's actions for ``tl``: its jobs, then what each pass of :data:`PASSES` adds."""
    _check_options(weight_cache)
    progs = job_actions(tl)
    for add in PASSES:
        progs = add(tl, progs, weight_cache)
    return progs


def lower(tl: Timeline, weight_cache: str = "step", prefetch: int = 1) -> Lowered:
    """Lower ``tl`` into per-worker programs; identical on every worker.

    ``plan.predicted`` is the simulator's :func:`~launcher.schedule.metrics.per_worker`, except
    ``weights_peak_resident`` under ``weight_cache="job"``: the exact peak of the engine running
    with lookahead ``prefetch`` (:func:`resident_peaks`), which the simulator cannot know.
    """
    _check_options(weight_cache, prefetch)
    return assemble(tl, lower_actions(tl, weight_cache), weight_cache, prefetch, check=False)


# ---- from actions to the plan ----------------------------------------------------------------

# the message kind of each send and receive, and whether it is the send
_MESSAGE = {SEND_ACT: (ACT, True), RECV_ACT: (ACT, False), SEND_GRAD: (GRAD, True), RECV_GRAD: (GRAD, False),
            SEND_WEIGHTS: (WEIGHTS, True), RECV_WEIGHTS: (WEIGHTS, False),
            SEND_WGRAD: (WGRAD, True), RECV_WGRAD: (WGRAD, False)}
# kinds about the job beside them -> the job kinds that may be (a gradient sum goes after B or W)
_OF_JOB = {SEND_ACT: "F", RECV_ACT: "F", SEND_GRAD: "BI", RECV_GRAD: "BI", RECV_WEIGHTS: "FBIW",
           FREE_WEIGHTS: "FBIW", SEND_WGRAD: "BW"}
_AT_END = frozenset((SEND_WEIGHTS, RECV_WGRAD, REDUCE))  # what may follow a worker's last job's own actions


def _belongs(prog: list[Action]) -> list[int]:
    """Per action, the index of the job it belongs to (:mod:`launcher.runtime.actions`): -1
    before the first job, the job count after the last."""
    out, count = [], 0
    for a in prog:
        if a.op in JOBS:
            out.append(count)
            count += 1
        else:
            out.append(count - 1 if a.op in AFTER else count)
    return out


def _check_actions(tl: Timeline, progs: Programs, belongs: list[list[int]]) -> None:
    """Each worker runs the timeline's jobs in its order; an action about a job of its own sits
    beside one of that stage (and micro-batch); a message goes to another worker."""
    S, W, owners = tl.step.space.S, tl.step.workers, _owners(tl)
    if len(progs) != W:
        raise LoweringError(f"the step has {W} workers but {len(progs)} programs")
    for w, (prog, want) in enumerate(zip(progs, _jobs(tl))):
        jobs = [n for n, a in enumerate(prog) if a.op in JOBS]
        if [prog[n] for n in jobs] != want:
            k = next((k for k, (n, a) in enumerate(zip(jobs, want)) if prog[n] != a), min(len(jobs), len(want)))
            raise _marked(progs, (w, jobs[k]) if k < len(jobs) else None,
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
                fits = a.op not in _OF_JOB or \
                    job.op in _OF_JOB[a.op] and a.stage == job.stage and a.microbatch in (job.microbatch, -1)
            if not fits or a.op == REDUCE and (w not in owners[a.stage] or len(owners[a.stage]) < 2):
                raise _marked(progs, (w, n), f"worker {w}'s {a!r} does not sit beside a job it belongs to",
                              "an action belongs to the job before it (sends, frees, REDUCE) or the one after it "
                              "(the rest); one about a job needs a job of its kind, stage and micro-batch; REDUCE "
                              "needs a replicated stage the worker owns")
            if (a.op in _MESSAGE or a.op == FREE_WGRAD) and not (0 <= a.peer < W and a.peer != w):
                raise _marked(progs, (w, n), f"worker {w}'s {a!r} names worker {a.peer}, not another of the {W}")


def messages(tl: Timeline, progs: Programs, belongs: list[list[int]]) -> tuple[list[Msg], list[dict[int, int]]]:
    """Every message of the step, and per worker its action index -> message id.

    A send and a receive match when kind, workers, stages and micro-batch agree (the k-th send with
    the k-th receive). Message ids: ``act``/``grad`` by consuming job, then ``weights`` by worker
    and job, then ``wgrad`` by stage, sender and owner.

    Message order, for NCCL: NCCL ignores tags, matches point-to-point operations between a pair of
    ranks in issue order, and runs a pair's operations (both directions) one after another. So every
    message gets a sort ``key``: the simulated time at which its data is ready at the sender
    (``act``/``grad``: the producing job's finish; ``wgrad``: the finish of the last job whose
    gradient it sums; ``weights``: the consuming job's start, since owners hold weights all step). An
    owner hands a weights message over just before its first job that starts at or after that key
    (``Program.weight_release``). Both ends issue a pair's operations in key order. A worker only
    ever waits for data whose key is earlier than the simulated start of the job that waits, so
    issuing in key order cannot deadlock (the simulated timeline is a witness).
    """
    ends: dict[tuple, tuple[list[tuple[int, int]], list[tuple[int, int]]]] = {}  # message -> sends, receives
    frees: list[tuple[int, int]] = []
    for w, prog in enumerate(progs):
        for n, a in enumerate(prog):
            if (kind := _MESSAGE.get(a.op)) is not None:
                ends.setdefault(_identity(w, a, *kind), ([], []))[not kind[1]].append((w, n))
            elif a.op == FREE_WGRAD:
                frees.append((w, n))
    found = []
    for ident, (sends, recvs) in ends.items():
        if len(sends) != len(recvs):
            w, n = (sends if len(sends) > len(recvs) else recvs)[min(len(sends), len(recvs))]
            raise _marked(progs, (w, n), f"worker {w}'s {progs[w][n]!r} has no matching "
                          f"{'receive' if len(sends) > len(recvs) else 'send'} on worker {progs[w][n].peer}")
        for send, recv in zip(sends, recvs):
            found.append((*_keyed(tl, progs, belongs, ident, send, recv), ident, send, recv))
    msgs: list[Msg] = []
    mids: list[dict[int, int]] = [{} for _ in progs]
    for _, key, (kind, src, dst, stage, mb, peer), (ws, ns), (wr, nr) in sorted(found, key=lambda f: f[0]):
        mids[ws][ns] = mids[wr][nr] = len(msgs)
        msgs.append(Msg(len(msgs), kind, src, dst, stage, mb, peer, key))
    wgrad = {(m.src, m.dst, m.stage): m.mid for m in msgs if m.kind == WGRAD}
    for w, n in frees:
        a = progs[w][n]
        if (w, a.peer, a.stage) not in wgrad:
            raise _marked(progs, (w, n), f"worker {w} frees a sum {a!r} it never sends")
        mids[w][n] = wgrad[(w, a.peer, a.stage)]
    return msgs, mids


def _identity(w: int, a: Action, kind: str, out: bool) -> tuple[str, int, int, int, int, int]:
    """``(kind, src, dst, stage, microbatch, peer_stage)`` of the message of ``kind`` that worker
    ``w`` sends (``out``) or receives by ``a``, as :class:`Msg` has them (act/grad: ``stage``
    produces the edge)."""
    src, dst = (w, a.peer) if out else (a.peer, w)
    sender, receiver = (a.stage, a.peer_stage) if out else (a.peer_stage, a.stage)
    if kind == ACT:
        return kind, src, dst, sender, a.microbatch, receiver
    if kind == GRAD:
        return kind, src, dst, receiver, a.microbatch, sender
    return kind, src, dst, a.stage, -1, a.stage


def _keyed(tl: Timeline, progs: Programs, belongs: list[list[int]], ident: tuple, send: tuple[int, int],
           recv: tuple[int, int]) -> tuple[tuple, tuple]:
    """The numbering order and the ``key`` (:func:`messages`) of the message ``ident`` sent by
    action ``send`` and received by action ``recv`` (each ``(worker, index)``)."""
    kind, src, dst, stage, _, peer = ident
    i = belongs[dst][recv[1]]
    producer = tl.program[src][belongs[src][send[1]]] if kind != WEIGHTS else -1
    consumer = tl.program[dst][i] if kind != WGRAD else -1
    if kind == WEIGHTS:
        return (1, dst, i), (tl.start[consumer], -1, consumer, consumer)
    if kind == WGRAD:
        return (2, stage, src, dst), (tl.finish[producer], 1, producer, dst)
    # the producer's place among the consumer's predecessors (JobSpace.pred), from the stage graph
    space = tl.step.space
    preds = space.stage_preds[peer] if kind == ACT else space.stage_succs[stage]
    if (stage if kind == ACT else peer) not in preds:
        raise _marked(progs, recv, f"worker {dst}'s {progs[dst][recv[1]]!r} carries no edge of the stage graph")
    return (0, consumer, preds.index(stage if kind == ACT else peer)), (tl.finish[producer], 0, producer, consumer)


def assemble(tl: Timeline, progs: Programs, weight_cache: str = "step", prefetch: int = 1,
               check: bool = True) -> Lowered:
    """The :class:`Lowered` that the per-worker actions ``progs`` describe (:func:`lower_actions`, or
    what :func:`~launcher.runtime.actions.parse_programs` reads back): messages paired, keyed and
    numbered (:func:`messages`), each worker's :class:`Program` filled in. With ``check``, an action
    that does not fit ``tl`` raises :class:`LoweringError` with the grid, that action marked (the
    passes' own programs fit by construction: :func:`lower` skips it)."""
    _check_options(weight_cache, prefetch)
    S, W = tl.step.space.S, tl.step.workers
    belongs = [_belongs(prog) for prog in progs]
    if check:
        _check_actions(tl, progs, belongs)
    msgs, mids = messages(tl, progs, belongs)
    if len(msgs) + 2 * S + S * reduce_rounds(W) > TAG_LIMIT:  # the step's tags, then the engine's ranges
        raise LoweringError(
            f"the step has {len(msgs):,} messages and {S} stages, more than the {TAG_LIMIT:,} point-to-point "
            f"message tags torch.distributed can tell apart; use fewer stages or micro-batches"
        )
    owners = _owners(tl)
    pair: list[dict[int, list[int]]] = [{} for _ in range(W)]
    for m in sorted(msgs, key=lambda m: m.key):
        pair[m.src].setdefault(m.dst, []).append(m.mid)
        pair[m.dst].setdefault(m.src, []).append(m.mid)
    programs = [_program(tl, w, progs[w], belongs[w], mids[w], msgs, owners, pair[w]) for w in range(W)]
    plan = Lowered(tl, weight_cache, msgs, programs, owners, per_worker(tl, weight_cache), prefetch,
                _reduce_order(tl, programs, owners))
    if weight_cache == "job":
        owned = plan.predicted["weights_owned"]
        plan.predicted["weights_peak_resident"] = [o + r for o, r in zip(owned, resident_peaks(plan, prefetch))]
    return plan


def _program(tl: Timeline, w: int, prog: list[Action], belongs: list[int], mids: dict[int, int], msgs: list[Msg],
             owners: list[list[int]], pair: dict[int, list[int]]) -> Program:
    """Worker ``w``'s :class:`Program` from its actions (``mids``: action index -> message id)."""
    jobs = [JobOp(j, a.stage, a.microbatch, a.op, tl.weights[j], start=tl.start[j])
            for j, a in zip(tl.program[w], (a for a in prog if a.op in JOBS))]
    reduces = {s: StageReduce(s, replicas=tuple(o) if len(o) > 1 else ()) for s, o in enumerate(owners) if w in o}
    held: dict[int, int] = {}  # stage -> the fetched copy its jobs here run on
    at: dict[str, dict[int, list[int]]] = {SEND_WEIGHTS: {}, RECV_WGRAD: {}, FREE_WGRAD: {}}  # job index -> mids
    ready: dict[int, int] = {}
    for n, (a, i) in enumerate(zip(prog, belongs)):
        mid = mids.get(n, -1)
        if a.op in at:
            if a.op == RECV_WGRAD:
                reduces.setdefault(a.stage, StageReduce(a.stage)).recv_from.append(mid)
            if i < len(jobs) or a.op == SEND_WEIGHTS:  # a sum received at the end is not posted
                at[a.op].setdefault(i, []).append(mid)
            continue
        if a.op == REDUCE:
            ready[a.stage] = i
            continue
        op = jobs[i]
        if a.op in JOBS:
            if op.owner != w:
                op.weights = held.get(a.stage)
        elif a.op in (RECV_ACT, RECV_GRAD):
            op.recv[a.peer_stage] = mid
        elif a.op in (SEND_ACT, SEND_GRAD):
            op.send.append(mid)
        elif a.op == RECV_WEIGHTS:
            held[a.stage] = mid
        elif a.op == FREE_WEIGHTS:
            op.free_weights = True
            held.pop(a.stage, None)
        elif a.op == SEND_WGRAD:
            op.wgrad_send.append(mid)
            reduces.setdefault(a.stage, StageReduce(a.stage)).send_to_owner[a.peer] = mid
    _in_id_order(jobs, reduces.values())

    def keyed(by_job: dict[int, list[int]]) -> dict[int, list[int]]:
        return {i: sorted(v, key=lambda mid: msgs[mid].key) for i, v in sorted(by_job.items())}

    return Program(w, jobs, [reduces[s] for s in sorted(reduces)], [s for s, o in enumerate(owners) if w in o], pair,
                   keyed(at[SEND_WEIGHTS]), {s: len(jobs) if reduces[s].recv_from else i for s, i in ready.items()},
                   keyed(at[RECV_WGRAD]), keyed(at[FREE_WGRAD]))


def _in_id_order(jobs: list[JobOp], reduces: Iterable[StageReduce]) -> None:
    """Each job's and stage's messages by id, whatever order the actions listed them in."""
    for op in jobs:
        op.send.sort()
        op.wgrad_send.sort()
        if len(op.recv) > 1:
            op.recv = dict(sorted(op.recv.items(), key=lambda kv: kv[1]))
    for red in reduces:
        red.send_to_owner = dict(sorted(red.send_to_owner.items(), key=lambda kv: kv[1]))
        red.recv_from.sort()


def _reduce_order(tl: Timeline, programs: list[Program], owners: list[list[int]]) -> list[int]:
    """Replicated stages in the one order every owner launches their all-reduces in: by when the
    last owner's share is complete on the simulated timeline (then owner set, stage)."""
    ready_time: dict[int, float] = {}
    for prog in programs:
        for s, i in prog.reduce_ready.items():
            t = tl.finish[prog.jobs[i].job] if 0 <= i < len(prog.jobs) else (0.0 if i < 0 else tl.latency)
            ready_time[s] = max(ready_time.get(s, 0.0), t)
    return sorted(ready_time, key=lambda s: (ready_time[s], tuple(owners[s]), s))


def resident_peaks(plan: Lowered, prefetch: int) -> list[int]:
    """Most fetched weight copies each worker's engine holds at once, with lookahead ``prefetch``.

    A copy is resident from the moment its receive buffer is posted (comm.py) until the engine
    frees it: at the end of its job (``F``/``B``), at the end of the ``W`` after an ``I``, or at the
    end of the step (cache ``step``). When a receive is posted depends only on the worker's own
    program, so this replays, without torch, the engine's order of calls (``Engine.train_step``:
    release owned weights ``prefetch`` jobs ahead, want the inputs and weights of the next
    ``prefetch + 1`` jobs and the partial sums to take in from this job on, run the job: its sends,
    its frees, then its partial sums for owners) through comm.py's issue rule
    (per peer in plan order, stopping at a send whose data is not ready; a receive is posted once
    wanted or once a later operation of the pair goes out).
    """
    msgs, out = plan.messages, []
    for prog in plan.programs:
        ready: set[int] = set()
        wanted: set[int] = set()
        nxt = {p: 0 for p in prog.pair_order}
        held = peak = 0

        def pump(peer: int) -> None:
            nonlocal held, peak
            q, i = prog.pair_order[peer], nxt[peer]
            last = i - 1
            for k in range(i, len(q)):
                if msgs[q[k]].src == prog.worker:
                    if q[k] not in ready:
                        break
                    last = k
                elif q[k] in wanted:
                    last = k
            for k in range(i, last + 1):
                if msgs[q[k]].dst == prog.worker and msgs[q[k]].kind == WEIGHTS:
                    held += 1
                    peak = max(peak, held)
            nxt[peer] = last + 1

        def send(mid: int) -> None:
            ready.add(mid)
            pump(msgs[mid].dst)

        def want(mid: int) -> None:
            if mid not in wanted:
                wanted.add(mid)
                pump(msgs[mid].src)

        jobs, released, kept = prog.jobs, -1, set()
        for i, op in enumerate(jobs):
            for r in range(released + 1, i + prefetch + 1):
                for mid in prog.weight_release.get(r, ()):
                    send(mid)
            released = max(released, i + prefetch)
            for nop in jobs[i : i + 1 + prefetch]:
                for mid in nop.recv.values():
                    want(mid)
                if nop.weights is not None:
                    want(nop.weights)
            for mid in prog.wgrad_post.get(i, ()):
                want(mid)
            for mid in op.send:
                send(mid)
            if op.kind == "I" and op.free_weights:
                kept.add((op.stage, op.microbatch))
            elif op.free_weights:
                held -= 1
            if op.kind == "W" and (op.stage, op.microbatch) in kept:
                kept.discard((op.stage, op.microbatch))
                held -= 1
            for mid in op.wgrad_send:  # after the job, as the engine sends them
                send(mid)
        out.append(peak)
    return out


def predicted_receives(plan: Lowered) -> dict[str, list[int]]:
    """What the simulator predicts the runtime will receive, per kind, in plan terms.

    ``weights`` is the distinct-stage fetch count with ``weight_cache="step"`` and the per-job
    count with ``"job"`` (the jobs that need a transfer): the two policies the simulator's metrics
    describe.
    """
    p = plan.predicted
    fetch = p["weight_fetch_stages"] if plan.weight_cache == "step" else p["weight_fetch_jobs"]
    return {ACT: list(p["act_recv"]), GRAD: list(p["grad_recv"]), WEIGHTS: list(fetch)}


def forward_only(plan: Lowered) -> Lowered:
    """The forward half of ``plan``, for evaluation: each worker's ``F`` jobs in the same order,
    the activation messages between them and the weights they run on; no gradients, no
    reduction. A subsequence of a deadlock-free pair order is deadlock-free (every wait is still
    for data keyed before the waiting job's simulated start), so this needs no new schedule."""
    keep: set[int] = set()
    programs: list[Program] = []
    for prog in plan.programs:
        jobs = [op for op in prog.jobs if op.kind == "F"]
        for op in jobs:
            keep.update(op.recv.values())
            keep.update(op.send)
            if op.weights is not None:
                keep.add(op.weights)
        programs.append(Program(prog.worker, jobs, [], prog.owned, {}, {}))
    for prog, old in zip(programs, plan.programs):
        prog.pair_order = {p: [m for m in q if m in keep] for p, q in old.pair_order.items()}
        prog.pair_order = {p: q for p, q in prog.pair_order.items() if q}
        # release points move with the jobs: index i of the old program -> forwards before it
        new_index, n = [], 0
        for op in old.jobs + [None]:
            new_index.append(n)
            n += op is not None and op.kind == "F"
        for i, mids in old.weight_release.items():
            kept = [m for m in mids if m in keep]
            if kept:
                prog.weight_release.setdefault(new_index[i], []).extend(kept)
    return Lowered(plan.timeline, plan.weight_cache, plan.messages, programs, plan.owners, plan.predicted,
                   plan.prefetch)
