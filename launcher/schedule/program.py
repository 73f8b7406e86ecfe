"""What each worker runs in a step (its :class:`Program`), and the one rule for when its messages go out.

Pure Python, no torch. :mod:`launcher.schedule.lowering` builds a :class:`Lowered` step (every
worker's program and the messages between them); a program's operations are its worker's actions
(:mod:`launcher.schedule.actions`) one for one, the engine runs them in order, and its communication
(:mod:`launcher.runtime.comm`) issues each peer's operations by :class:`PairIssue`.
:func:`resident_peaks` walks the same operations through the same rule without torch, so the
weight copies the engine holds are predicted by the code that decides them, not by a copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Sequence

from .actions import AFTER, JOBS, POSTED, RECV_WGRAD, REDUCE, SEND_GRAD, SEND_WGRAD, SENDS
from .settings import DEFAULT
from .simulate import Timeline

ACT, GRAD, WEIGHTS, WGRAD = "act", "grad", "weights", "wgrad"
KINDS = (ACT, GRAD, WEIGHTS, WGRAD)


def reduce_rounds(n: int) -> int:
    """Message rounds of one all-reduce among at most ``n`` workers by recursive halving and
    doubling (:mod:`launcher.runtime.collectives`): ``2 log2(p)`` for the largest power of two
    ``p <= n``, plus 2 to fold in the rest."""
    return 2 * max(n.bit_length() - 1, 0) + 2


class Msg(NamedTuple):
    """One point-to-point message of the step (a tuple: cheap to make by the hundred thousand).

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


@dataclass(slots=True)
class JobOp:
    """A compute job of a program. What it sends, and the partial sums that go out after it, are
    the program's operations (``SEND_ACT``, ``SEND_GRAD``, ``SEND_WGRAD``) and nothing here. The
    fields below that name messages are the bindings the job needs when it runs, which its place
    among the operations does not give: a receive stands where it is posted, possibly jobs earlier
    (:func:`~launcher.schedule.lowering.post_early`), and a copy of the weights may have arrived for
    an earlier job (``weight_cache="step"``)."""

    job: int
    stage: int
    microbatch: int
    kind: str
    owner: int  # w_owner: the worker that owns this job's stage
    # pred stage (F) or succ stage (B/I) -> the message the job waits for (its RECV_ACT/RECV_GRAD)
    recv: dict[int, int] = field(default_factory=dict)
    weights_mid: int | None = None  # the weights message this job runs on (None: owned stage)
    # its FREE_WEIGHTS: the copy goes when the job ends (an I: when its W does); the forward reads it
    # to keep only its input (recompute) rather than a graph holding the copy
    free_weights: bool = False
    start: float = 0.0  # simulated start, for reports


@dataclass(slots=True)
class StageReduce:
    """The gradient traffic of one stage on one worker, read from its program's operations
    (:func:`stage_reduces`): a summary for reports and tests, which the runtime does not read (it
    runs the ``SEND_WGRAD``, ``RECV_WGRAD`` and ``REDUCE`` operations where they stand)."""

    stage: int
    send_to_owner: dict[int, int] = field(default_factory=dict)  # owner -> wgrad mid (sent after a job)
    recv_from: list[int] = field(default_factory=list)  # wgrad mids into this owner
    replicas: tuple[int, ...] = ()  # the owners that all-reduce this stage (empty: one owner)


#: one operation of a worker's program: an action's kind and its argument (a job: its index in
#: ``Program.jobs``; a message: its id; ``REDUCE``: the stage)
Op = tuple[str, int]


@dataclass
class Program:
    """Everything one worker does in a step, in order: :attr:`ops` are its actions
    (:mod:`launcher.schedule.actions`) one for one, as printed, with each message's id resolved;
    the engine runs them as they stand. A fetched copy's free when its job ends (``FREE_WEIGHTS``)
    is the :class:`JobOp`'s ``free_weights``, done by the job itself."""

    worker: int
    jobs: list[JobOp]
    reduces: list[StageReduce]  # derived from ``ops`` (:func:`stage_reduces`), for reports and tests
    owned: list[int]  # stages this worker is a source of truth for
    pair_order: dict[int, list[int]]  # peer -> mids to or from that peer, in issue order
    ops: list[Op] = field(default_factory=list)
    # where the end of the step's operations start (after the last job's own): the owner's last
    # hand-overs, the partial sums it takes in and the reductions that wait for them
    tail: int = 0

    def reduce_points(self) -> dict[int, int]:
        """Per replicated stage this worker owns, the job after which its share of the stage's
        gradient is complete (its ``REDUCE``): -1 at once (it computes nothing of the stage),
        ``len(jobs)`` at the end of the step (partial sums come in from others)."""
        out, i = {}, -1
        for n, (op, arg) in enumerate(self.ops):
            if op in JOBS:
                i = arg
            elif op == REDUCE:
                out[arg] = len(self.jobs) if n >= self.tail else i
        return out


def stage_reduces(worker: int, ops: Sequence[Op], messages: Sequence[Msg], owners: Sequence[Sequence[int]],
                  frozen: frozenset[int] = frozenset()) -> list[StageReduce]:
    """Per stage the worker owns or sends a partial sum of, in stage order, what its operations do
    with the stage's gradient: the sums it sends (``SEND_WGRAD``) and takes in (``RECV_WGRAD``), by
    message id, and the owners it all-reduces with (a ``REDUCE``: a replicated stage, not frozen)."""
    out = {s: StageReduce(s) for s, o in enumerate(owners) if worker in o}
    for kind, arg in ops:
        if kind == SEND_WGRAD:
            m = messages[arg]
            out.setdefault(m.stage, StageReduce(m.stage)).send_to_owner[m.dst] = arg
        elif kind == RECV_WGRAD:
            m = messages[arg]
            out.setdefault(m.stage, StageReduce(m.stage)).recv_from.append(arg)
        elif kind == REDUCE and arg not in frozen:
            out[arg].replicas = tuple(owners[arg])
    for red in out.values():  # by message id, whatever order the actions list them in
        red.send_to_owner = dict(sorted(red.send_to_owner.items(), key=lambda kv: kv[1]))
        red.recv_from.sort()
    return [out[s] for s in sorted(out)]


def tail_of(ops: list[Op]) -> int:
    """Where the end of the step's operations start: after the last job and its own operations
    (the kinds of :data:`~launcher.schedule.actions.AFTER`), or after the leading ones if no job."""
    tail = next((n + 1 for n in range(len(ops) - 1, -1, -1) if ops[n][0] in JOBS), 0)
    while tail < len(ops) and ops[tail][0] in _AFTER:
        tail += 1
    return tail


_AFTER = frozenset(AFTER)


@dataclass
class Lowered:
    """The step lowered for every worker, plus the counts the simulator predicts."""

    timeline: Timeline
    weight_cache: str
    messages: list[Msg]
    programs: list[Program]
    owners: list[list[int]]  # stage -> sorted owner workers
    predicted: dict[str, list]
    prefetch: int = DEFAULT.prefetch  # the engine's lookahead (jobs) that ``predicted["weights_peak_resident"]`` is for
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
        return self.tag_base + 2 * self.timeline.schedule.space.S + bucket * reduce_rounds(self.workers) + round_

    def counts(self) -> dict[str, list[int]]:
        """Messages received per worker and kind, straight from the programs."""
        out = {k: [0] * self.workers for k in KINDS}
        for m in self.messages:
            out[m.kind][m.dst] += 1
        return out


class PairIssue:
    """When one worker's messages of a step go out: the rule its communication follows.

    NCCL matches a pair's point-to-point operations in issue order, so per peer the operations
    are issued strictly in the program's pair order. A send is *ready* once its data exists; a
    receive is *wanted* once the engine asks for it (its job within the prefetch window). Issuing
    stops at the first send that is not ready; a receive that is not wanted yet is posted early
    when a later operation of the same pair is wanted or ready (posting a receive never blocks).
    :meth:`ready` and :meth:`want` return the operations that may go out now, in order.
    """

    def __init__(self, messages: Sequence[Msg], worker: int, pair_order: Mapping[int, list[int]]) -> None:
        self.msgs = messages
        self.me = worker
        self.queue = pair_order
        self.next = {p: 0 for p in pair_order}
        # where each message stands in its pair's order, and per pair the furthest operation that is
        # wanted or ready: nothing past it can be issued, so a pump never scans beyond it
        self.pos = {mid: k for q in pair_order.values() for k, mid in enumerate(q)}
        self.horizon = {p: -1 for p in pair_order}
        self.sendable: set[int] = set()  # ready sends not issued yet
        self.wanted: set[int] = set()

    def ready(self, mid: int) -> list[int]:
        """The data of outgoing ``mid`` exists: the operations that go out now."""
        self.sendable.add(mid)
        return self.pump(self._reach(mid))

    def want(self, mid: int) -> list[int]:
        """The engine asks for incoming ``mid``: the operations that go out now (none if asked before)."""
        if mid in self.wanted:
            return []
        self.wanted.add(mid)
        return self.pump(self._reach(mid))

    def pump(self, peer: int) -> list[int]:
        """Issue the pair's operations in order, up to the furthest wanted or ready one, stopping
        at a send whose data does not exist yet (receives before it are posted early)."""
        q, i = self.queue[peer], self.next[peer]
        last = i - 1
        for k in range(i, self.horizon[peer] + 1):
            if q[k] not in self.sendable and self.msgs[q[k]].src == self.me:
                break
            last = k
        out = q[i : last + 1]
        self.sendable.difference_update(out)
        self.next[peer] = last + 1
        return out

    def pending(self, peer: int) -> list[int]:
        """The pair's operations not issued yet."""
        return self.queue[peer][self.next[peer] :]

    def _reach(self, mid: int) -> int:
        """Extend the pair's horizon to ``mid``; return the peer."""
        m = self.msgs[mid]
        peer = m.dst if m.src == self.me else m.src
        if self.pos[mid] > self.horizon[peer]:
            self.horizon[peer] = self.pos[mid]
        return peer


def resident_peaks(lowered: Lowered, prefetch: int) -> list[int]:
    """Most fetched weight copies each worker's engine holds at once, with lookahead ``prefetch``
    (the one its programs were lowered for).

    A copy is resident from the moment its receive buffer is posted until the engine frees it: at
    the end of its job (``F``/``B``), at the end of the ``W`` after an ``I``, or at the end of the
    step (cache ``step``). When a receive is posted depends only on the worker's own program, so
    this walks its operations as the engine runs them (:attr:`Program.ops`) through the same
    :class:`PairIssue` its communication follows.
    """
    msgs, out = lowered.messages, []
    for prog in lowered.programs:
        issue = PairIssue(msgs, prog.worker, prog.pair_order)
        held = peak = 0

        def posted(mids: list[int]) -> None:
            nonlocal held, peak
            for mid in mids:
                if msgs[mid].kind == WEIGHTS and msgs[mid].dst == prog.worker:
                    held += 1
                    peak = max(peak, held)

        kept: set[tuple[int, int]] = set()
        for n, (kind, arg) in enumerate(prog.ops):
            if kind in JOBS:
                op = prog.jobs[arg]
                if op.kind == "I" and op.free_weights:
                    kept.add((op.stage, op.microbatch))
                elif op.free_weights:
                    held -= 1
                if op.kind == "W" and (op.stage, op.microbatch) in kept:
                    kept.discard((op.stage, op.microbatch))
                    held -= 1
            elif kind in SENDS:
                posted(issue.ready(arg))
            elif kind in POSTED or kind == RECV_WGRAD and n < prog.tail:
                posted(issue.want(arg))
        out.append(peak)
    return out


def predicted_receives(lowered: Lowered) -> dict[str, list[int]]:
    """What the simulator predicts the runtime will receive, per kind, in the programs' terms.

    ``weights`` is the distinct-stage fetch count with ``weight_cache="step"`` and the per-job
    count with ``"job"`` (the jobs that need a transfer): the two policies the simulator's metrics
    describe.
    """
    p = lowered.predicted
    fetch = p["weight_fetch_stages"] if lowered.weight_cache == "step" else p["weight_fetch_jobs"]
    return {ACT: list(p["act_recv"]), GRAD: list(p["grad_recv"]), WEIGHTS: list(fetch)}


def forward_only(lowered: Lowered) -> Lowered:
    """The forward half of ``lowered``, for evaluation: each worker's ``F`` jobs and their
    operations in the same order (the activation messages between them and the weights they run
    on); no gradients, no reduction. A subsequence of a deadlock-free pair order is deadlock-free
    (every wait is still for data keyed before the waiting job's simulated start), so this needs no
    new schedule."""
    keep = {m.mid for m in lowered.messages if m.kind == ACT}  # every activation feeds a forward
    for prog in lowered.programs:
        for op in prog.jobs:
            if op.kind == "F" and op.weights_mid is not None:
                keep.add(op.weights_mid)
    programs: list[Program] = []
    for old in lowered.programs:
        jobs: list[JobOp] = []
        ops: list[Op] = []
        for kind, arg in old.ops:
            if kind == "F":
                ops.append((kind, len(jobs)))
                jobs.append(old.jobs[arg])
            elif (kind in POSTED or kind in SENDS) and arg in keep:
                ops.append((kind, arg))
        pair = {p: [m for m in q if m in keep] for p, q in old.pair_order.items()}
        programs.append(Program(old.worker, jobs, [], old.owned, {p: q for p, q in pair.items() if q}, ops,
                                tail_of(ops)))
    return Lowered(lowered.timeline, lowered.weight_cache, lowered.messages, programs, lowered.owners,
                   lowered.predicted, lowered.prefetch)


def whole_backwards(lowered: Lowered, worker: int) -> frozenset[tuple[int, int]]:
    """The ``(stage, micro-batch)`` pairs whose ``I`` the worker runs as one whole backward (its
    ``W`` then does nothing): an ``I`` its program follows at once by its own ``W``, with the
    weights' total on the same owner, and whose input gradients, if it sends any, are not needed
    before the ``W`` ends on the simulated step (each receiver's ``I`` starts no earlier than that
    ``W``'s finish plus the crossing).

    Why: ``I`` then ``W`` cost 1.36 to 1.43 times one whole backward on a GPT stage (two autograd
    calls, docs/performance.md), so a split pays only where ``I``'s early gradient lets a peer
    start sooner, which is where a zero-bubble order puts the ``W`` later to fill the wait. An
    adjacent pair whose receiver is busy until after the ``W`` anyway (DualPipeV's full backwards,
    PyTorch's ``FULL_BACKWARD``) delays no one by sending at the end of the whole backward."""
    prog, tl = lowered.programs[worker], lowered.timeline
    sched, space = tl.schedule, tl.schedule.space
    if "I" not in space.kinds:
        return frozenset()
    sends: dict[int, list[Msg]] = {}  # job index -> the input gradients sent after it
    last = -1
    for kind, arg in prog.ops:
        if kind in JOBS:
            last = arg
        elif kind == SEND_GRAD:
            sends.setdefault(last, []).append(lowered.messages[arg])
    out: set[tuple[int, int]] = set()
    jobs = prog.jobs
    for n, (i, w) in enumerate(zip(jobs, jobs[1:])):
        if not (i.kind == "I" and w.kind == "W" and (i.stage, i.microbatch) == (w.stage, w.microbatch)
                and i.owner == w.owner):  # the weights' total is W's owner's
            continue
        end = tl.finish[w.job]
        if all(tl.start[space.id(m.stage, m.microbatch, "I")] >= end + sched.crossing(m.src, m.dst)
               for m in sends.get(n, ())):
            out.add((i.stage, i.microbatch))
    return frozenset(out)
