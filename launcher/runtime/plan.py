"""Lower a simulated :class:`~launcher.schedule.Timeline` into one program per worker.

Pure Python, no torch. Every worker calls :func:`lower` on the same timeline and gets the same
:class:`Plan`, so every send has its matching receive without a coordinator.

What the placement implies (DESIGN.md section 2), as messages:

- ``act``: ``F(p,b) -> F(c,b)`` across workers carries ``x_c^b`` (the output of stage ``p``);
- ``grad``: backward ``(c,b) -> (p,b)`` across workers carries ``dL/d(output of p)``;
- ``weights``: a job with ``w_compute != w_weights`` runs on a copy of stage ``s`` sent by the
  owner ``w_weights``. With ``weight_cache="step"`` a worker fetches each stage once, for the
  first job that needs it, and keeps it to the end of the step; with ``"job"`` every such job
  fetches its own copy and frees it when it finishes, except that a backward whose forward ran on
  this worker's own weights backpropagates through that forward's graph (no copy), and a ``W``
  takes its gradient from its ``I``'s graph, on the copy ``I`` kept until then (no copy either);
- ``wgrad``: each worker sends its weight-gradient sum of a stage to every other owner it
  computed for (one message per ``(stage, owner)``) as soon as its last backward of that stage
  for that owner ends, so the transfer overlaps the rest of its backward;
- replicas: the owners of a replicated stage (DDP, LPP with G > 1) all-reduce its gradient on
  their own subgroup (a collective, not a message: :mod:`launcher.runtime.groups`) once their
  partial sums are in; then each owner steps its optimizer for the stages it owns.

Message order, for NCCL: NCCL ignores tags, matches point-to-point operations between a pair of
ranks in issue order, and runs a pair's operations (both directions) one after another. So every
message gets a sort ``key``: the simulated time at which its data is ready at the sender
(``act``/``grad``: the producing job's finish; ``wgrad``: the finish of the last job whose
gradient it sums; ``weights``: the consuming job's start, since owners hold weights all step). An owner hands a weights message over just
before its first job that starts at or after that key (``Program.weight_release``). Both ends issue a pair's operations in key
order. A worker only ever waits for data whose key is earlier than the simulated start of the job
that waits, so issuing in key order cannot deadlock (the simulated timeline is a witness).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from launcher.schedule.memory import sum_handovers
from launcher.schedule.metrics import WEIGHT_CACHES, per_worker
from launcher.schedule.simulate import Timeline

ACT, GRAD, WEIGHTS, WGRAD = "act", "grad", "weights", "wgrad"
KINDS = (ACT, GRAD, WEIGHTS, WGRAD)


#: point-to-point tags are C ints: a message's tag is its id, the engine's own exchanges follow
TAG_LIMIT = 2**31 - 1


def reduce_rounds(n: int) -> int:
    """Message rounds of one all-reduce among at most ``n`` workers by recursive halving and
    doubling (:mod:`launcher.runtime.collectives`): ``2 log2(p)`` for the largest power of two
    ``p <= n``, plus 2 to fold in the rest."""
    return 2 * max(n.bit_length() - 1, 0) + 2


class PlanError(ValueError):
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
class Plan:
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


def _check_colocated(tl: Timeline) -> None:
    """Every job of ``(s, b)`` must run where ``F(s, b)`` ran: its activation stash lives there."""
    space = tl.step.space
    SB = space.S * space.B
    for j in range(SB, space.N):
        if tl.compute[j] != tl.compute[j % SB]:
            s, b, d = space.job(j)
            raise PlanError(
                f"placement {tl.step.name} runs F({s},{b}) on worker {tl.compute[j % SB]} but "
                f"{d}({s},{b}) on worker {tl.compute[j]}; the runtime needs every job of a "
                f"(stage, micro-batch) on the worker that holds its activations"
            )


def lower(tl: Timeline, weight_cache: str = "step", prefetch: int = 1) -> Plan:
    """Lower ``tl`` into per-worker programs; identical on every worker.

    ``plan.predicted`` is the simulator's :func:`~launcher.schedule.metrics.per_worker`, except
    ``weights_peak_resident`` under ``weight_cache="job"``: the exact peak of the engine running
    with lookahead ``prefetch`` (:func:`resident_peaks`), which the simulator cannot know.
    """
    if weight_cache not in WEIGHT_CACHES:
        raise PlanError(f"weight_cache={weight_cache!r} is not valid; choose one of {list(WEIGHT_CACHES)}")
    if not (isinstance(prefetch, int) and prefetch >= 0):
        raise PlanError(f"prefetch={prefetch!r} is not valid; it must be an int >= 0 (jobs of lookahead)")
    _check_colocated(tl)
    space, W = tl.step.space, tl.step.workers
    S, B, SB = space.S, space.B, space.S * space.B
    comp, wts = tl.compute, tl.weights
    msgs: list[Msg] = []

    def new(kind: str, src: int, dst: int, stage: int, mb: int, peer: int, key: tuple) -> int:
        msgs.append(Msg(len(msgs), kind, src, dst, stage, mb, peer, key))
        return len(msgs) - 1

    ops: dict[int, JobOp] = {}
    for w in range(W):
        for j in tl.program[w]:
            s, b, d = space.job(j)
            ops[j] = JobOp(j, s, b, d, wts[j], start=tl.start[j])

    # activations and gradients: one message per edge of the job graph that crosses workers
    for j in range(SB * 2):
        k, s = divmod(j // B, S)
        b = j % B
        for p in space.pred(j):
            if comp[p] == comp[j] or p // SB != k:  # local, or the loss stage's F -> B
                continue
            ps = (p // B) % S
            if k == 0:  # F(ps,b) -> F(s,b): the output of ps
                mid = new(ACT, comp[p], comp[j], ps, b, s, (tl.finish[p], 0, p, j))
            else:  # backward(ps,b) -> backward(s,b): dL/d(output of s), from stage ps
                mid = new(GRAD, comp[p], comp[j], s, b, ps, (tl.finish[p], 0, p, j))
            ops[j].recv[ps] = mid
            ops[p].send.append(mid)

    # weights: per job (cache "job") or per (worker, stage) for the first job that needs it
    for w in range(W):
        cached: dict[int, int] = {}
        for j in tl.program[w]:
            op = ops[j]
            if op.owner == w:
                continue
            if weight_cache == "job":
                f = ops.get(j % SB)  # F(s, b), here (the placement is colocated)
                if op.kind == "W" or (op.kind != "F" and f is not None and f.owner == w):
                    continue  # reuses the graph (and copy) of F or I: no transfer
                op.weights = new(WEIGHTS, op.owner, w, op.stage, -1, op.stage, (tl.start[j], -1, j, j))
                op.free_weights = True
            else:
                if op.stage not in cached:
                    cached[op.stage] = new(WEIGHTS, op.owner, w, op.stage, -1, op.stage, (tl.start[j], -1, j, j))
                op.weights = cached[op.stage]

    # gradient sums to owners: each goes out after the last job of the worker that adds to it
    owners: list[set[int]] = [set() for _ in range(S)]
    for j in range(space.N):
        owners[(j // B) % S].add(wts[j])
    grad_kind = space.K - 1  # B, or W when split: the job that yields stage s's weight gradient
    last: dict[tuple[int, int, int], int] = {}  # (stage, worker, owner) -> its last gradient job
    for w in range(W):
        for j in tl.program[w]:
            if j // SB == grad_kind and wts[j] != w:
                last[((j // B) % S, w, wts[j])] = j
    reduces: list[dict[int, StageReduce]] = [{} for _ in range(W)]

    def red(w: int, s: int) -> StageReduce:
        return reduces[w].setdefault(s, StageReduce(s))

    for (s, w, o), j in sorted(last.items()):
        mid = new(WGRAD, w, o, s, -1, s, (tl.finish[j], 1, j, o))  # after the job's act/grad sends
        ops[j].wgrad_send.append(mid)
        red(w, s).send_to_owner[o] = mid
        red(o, s).recv_from.append(mid)
    for s in range(S):
        os_ = tuple(sorted(owners[s]))
        for o in os_:
            red(o, s).replicas = os_ if len(os_) > 1 else ()
    # when each owner's share of a replicated stage is complete: after its last gradient job of
    # the stage that it owns itself, or at the end of its program if others send it partial sums
    ready: list[dict[int, int]] = [{} for _ in range(W)]
    ready_time: dict[int, float] = {}
    for w in range(W):
        prog = tl.program[w]
        for i, j in enumerate(prog):
            s = (j // B) % S
            if j // SB == grad_kind and wts[j] == w and len(owners[s]) > 1:
                ready[w][s] = i
        for s in range(S):  # an owner that computes nothing of its stage is ready at once
            if len(owners[s]) > 1 and w in owners[s] and s not in ready[w]:
                ready[w][s] = -1
        for s in ready[w]:
            if reduces[w][s].recv_from:  # it waits for the partial sums: at the end
                ready[w][s] = len(prog)
            i = ready[w][s]
            t = tl.finish[prog[i]] if 0 <= i < len(prog) else (0.0 if i < 0 else tl.latency)
            ready_time[s] = max(ready_time.get(s, 0.0), t)
    reduce_order = sorted(ready_time, key=lambda s: (ready_time[s], tuple(sorted(owners[s])), s))

    if len(msgs) + 2 * S + S * reduce_rounds(W) > TAG_LIMIT:  # the step's tags, then the engine's ranges
        raise PlanError(
            f"the step has {len(msgs):,} messages and {S} stages, more than the {TAG_LIMIT:,} point-to-point "
            f"message tags torch.distributed can tell apart; use fewer stages or micro-batches"
        )
    pair: list[dict[int, list[int]]] = [{} for _ in range(W)]
    for m in sorted(msgs, key=lambda m: m.key):
        pair[m.src].setdefault(m.dst, []).append(m.mid)
        pair[m.dst].setdefault(m.src, []).append(m.mid)
    release: list[dict[int, list[int]]] = [{} for _ in range(W)]
    for m in msgs:
        if m.kind == WEIGHTS:
            starts = [tl.start[j] for j in tl.program[m.src]]
            release[m.src].setdefault(bisect_left(starts, m.key[0]), []).append(m.mid)
    post: list[dict[int, list[int]]] = [{} for _ in range(W)]
    deliver: list[dict[int, list[int]]] = [{} for _ in range(W)]
    if weight_cache == "job":  # partial sums handed over during the step (schedule.memory's rule)
        for h in sum_handovers(tl):
            mid = reduces[h.sender][h.stage].send_to_owner[h.owner]
            if h.post is not None:
                post[h.owner].setdefault(h.post, []).append(mid)
            if h.deliver is not None:
                deliver[h.sender].setdefault(h.deliver, []).append(mid)
    programs = [
        Program(
            w,
            [ops[j] for j in tl.program[w]],
            [reduces[w][s] for s in sorted(reduces[w])],
            sorted(s for s in range(S) if w in owners[s]),
            pair[w],
            {i: sorted(v, key=lambda mid: msgs[mid].key) for i, v in sorted(release[w].items())},
            ready[w],
            {i: sorted(v, key=lambda mid: msgs[mid].key) for i, v in sorted(post[w].items())},
            {i: sorted(v, key=lambda mid: msgs[mid].key) for i, v in sorted(deliver[w].items())},
        )
        for w in range(W)
    ]
    plan = Plan(tl, weight_cache, msgs, programs, [sorted(o) for o in owners], per_worker(tl, weight_cache), prefetch,
                reduce_order)
    if weight_cache == "job":
        owned = plan.predicted["weights_owned"]
        plan.predicted["weights_peak_resident"] = [o + r for o, r in zip(owned, resident_peaks(plan, prefetch))]
    return plan


def resident_peaks(plan: Plan, prefetch: int) -> list[int]:
    """Most fetched weight copies each worker's engine holds at once, with lookahead ``prefetch``.

    A copy is resident from the moment its receive buffer is posted (comm.py) until the engine
    frees it: at the end of its job (``F``/``B``), at the end of the ``W`` after an ``I``, or at the
    end of the step (cache ``step``). When a receive is posted depends only on the worker's own
    program, so this replays, without torch, the engine's order of calls (``Engine.train_step``:
    release owned weights ``prefetch`` jobs ahead, want the inputs and weights of the next
    ``prefetch + 1`` jobs and the partial sums to take in from this job on, run the job: its sends, its frees, then its partial sums for owners)
    through comm.py's issue rule
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


def predicted_receives(plan: Plan) -> dict[str, list[int]]:
    """What the simulator predicts the runtime will receive, per kind, in plan terms.

    ``weights`` is the distinct-stage fetch count with ``weight_cache="step"`` and the per-job
    count with ``"job"`` (the jobs that need a transfer): the two policies the simulator's metrics
    describe.
    """
    p = plan.predicted
    fetch = p["weight_fetch_stages"] if plan.weight_cache == "step" else p["weight_fetch_jobs"]
    return {ACT: list(p["act_recv"]), GRAD: list(p["grad_recv"]), WEIGHTS: list(fetch)}


def forward_only(plan: Plan) -> Plan:
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
    return Plan(plan.timeline, plan.weight_cache, plan.messages, programs, plan.owners, plan.predicted, plan.prefetch)
