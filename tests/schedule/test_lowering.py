"""The plan: pure-Python lowering of a timeline into per-worker programs (no processes)."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from launcher.schedule import ScheduleError, make_schedule, simulate
from launcher.schedule.actions import (
    COMPUTE,
    RECV_ACT,
    RECV_GRAD,
    RECV_WEIGHTS,
    RECV_WGRAD,
    SEND_WEIGHTS,
    SEND_WGRAD,
    SENDS,
)
from launcher.schedule.lowering import LoweringError, early, lower, weight_messages
from launcher.schedule.metrics import per_worker
from launcher.schedule.program import (
    ACT,
    GRAD,
    WEIGHTS,
    WGRAD,
    Lowered,
    PairIssue,
    predicted_receives,
    resident_peaks,
)

SCHEMES = [("ddp", 4, 1, 3, 4), ("fsdp", 4, 1, 4, 4), ("gpipe", 1, 4, 4, 6), ("lpp", 2, 2, 4, 4),
           ("fslpp", 2, 2, 4, 4), ("lpp", 2, 2, 8, 8), ("fslpp", 4, 2, 8, 8)]
ORDERS = ["1f1b", "breadth_first", "depth_first"]


def _end_phase(plan: Lowered, w: int) -> list[tuple[str, int]]:
    """The engine's end-of-step operations on worker ``w``, in its order: the partial sums sent
    to its stages, then one all-reduce phase if it owns a replicated stage (``("allreduce", -1)``)."""
    out = []
    reduces = [red for red in plan.programs[w].reduces if red.stage in plan.programs[w].owned]
    for red in reduces:
        out += [("wait", m) for m in red.recv_from]
    if any(red.replicas for red in reduces):
        out.append(("allreduce", -1))
    return out


def execute_abstract(plan: Lowered) -> None:
    """Run every worker's program under NCCL's rules, without torch, and fail on a deadlock.

    NCCL: a pair's operations (both directions) complete strictly in issue order, and the k-th
    operation completes only once both ends issued it. Workers issue with the engine's rule (per
    peer in plan order, stop at an unready send, post earlier receives when something later goes).
    The replicas' all-reduce completes once every member of each of the worker's owner sets has
    reached its own all-reduce phase.
    """
    W, msgs = plan.workers, plan.messages
    flat: list[list[tuple[str, int]]] = []
    for w, prog in enumerate(plan.programs):
        ops: list[tuple[str, int]] = []
        for kind, arg in prog.ops:  # as the engine runs them; a job waits for its inputs and weights
            if kind in COMPUTE:
                op = prog.jobs[arg]
                ops += [("wait", m) for m in op.recv.values()]
                if op.weights_mid is not None:
                    ops.append(("wait", op.weights_mid))
            elif kind in SENDS:
                ops.append(("send", arg))
        flat.append(ops + _end_phase(plan, w))
    ready: list[set[int]] = [set() for _ in range(W)]
    wanted: list[set[int]] = [set() for _ in range(W)]
    issued = [{p: 0 for p in plan.programs[w].pair_order} for w in range(W)]
    done: set[int] = set()
    pc = [0] * W

    def pump(w: int, p: int) -> None:
        q = plan.programs[w].pair_order[p]
        last = issued[w][p] - 1
        for k in range(issued[w][p], len(q)):
            m = msgs[q[k]]
            if m.src == w and q[k] not in ready[w]:
                break
            if m.src == w or q[k] in wanted[w]:
                last = k
        issued[w][p] = max(issued[w][p], last + 1)

    def complete() -> None:  # a pair's k-th message is delivered once both ends issued 0..k
        for a in range(W):
            for b, q in plan.programs[a].pair_order.items():
                n = min(issued[a][b], issued[b][a])
                for mid in q[:n]:
                    done.add(mid)

    arrived: set[int] = set()  # workers at their all-reduce phase
    sets = [{o for owners in plan.owners if w in owners and len(owners) > 1 for o in owners} for w in range(W)]
    progress = True
    while progress:
        progress = False
        for w in range(W):
            while pc[w] < len(flat[w]):
                kind, mid = flat[w][pc[w]]
                if kind == "allreduce":
                    arrived.add(w)
                    if not sets[w] <= arrived:
                        break
                    pc[w] += 1
                    progress = True
                    continue
                m = msgs[mid]
                peer = m.dst if m.src == w else m.src
                if kind == "send":
                    ready[w].add(mid)
                else:
                    wanted[w].add(mid)
                pump(w, peer)
                complete()
                if kind == "wait" and mid not in done:
                    break
                pc[w] += 1
                progress = True
    stuck = {w: flat[w][pc[w]] for w in range(W) if pc[w] < len(flat[w])}
    assert not stuck, f"deadlock under NCCL ordering: workers wait at {stuck}"
    for w in range(W):
        for p in plan.programs[w].pair_order:
            pump(w, p)
            assert issued[w][p] == len(plan.programs[w].pair_order[p]), f"worker {w} left messages to {p} unissued"


def _check_weights(plan: Lowered) -> None:
    """Weight copies: what the plan sends and the resident peak it predicts, against the simulator."""
    p, tl = plan.predicted, plan.timeline
    sim = per_worker(tl, plan.weight_cache)
    assert p["stash_recv"] == [0] * plan.workers  # colocated placements only: no stash ever moves
    for prog in plan.programs:
        for op in prog.jobs:
            if plan.weight_cache == "job" and op.kind == "W":
                assert op.weights_mid is None, "a W runs on its I's graph: no transfer"
    peaks = [o + r for o, r in zip(p["weights_owned"], resident_peaks(plan, plan.prefetch))]
    assert peaks == p["weights_peak_resident"]
    if plan.weight_cache == "step":  # every fetched stage stays: lookahead changes nothing
        assert p == sim
        for k in (0, 3):
            assert [o + r for o, r in zip(p["weights_owned"], resident_peaks(plan, k))] == sim["weights_peak_resident"]
    else:  # the simulator's value assumes no lookahead: a lower bound
        assert all(a >= b for a, b in zip(p["weights_peak_resident"], sim["weights_peak_resident"]))
        assert {k: v for k, v in p.items() if k != "weights_peak_resident"} == \
            {k: v for k, v in sim.items() if k != "weights_peak_resident"}


def test_job_cache_peak_counts_the_lookahead():
    """FSDP on 4 workers, cache job: the reviewer's case; the engine holds prefetched copies too."""
    tl = simulate(make_schedule("fsdp", 4, 4, G=4, R=1))
    assert per_worker(tl, "job")["weights_peak_resident"] == [2, 2, 2, 2]
    assert lower(tl, "job", 0).predicted["weights_peak_resident"] == [2, 2, 2, 2]
    assert lower(tl, "job", 2).predicted["weights_peak_resident"] == [4, 4, 3, 4]
    split = simulate(make_schedule("fsdp", 4, 4, G=4, R=1, split_backward=True))
    # an I keeps its copy until its W, which fetches none
    assert per_worker(split, "job")["weights_peak_resident"] == [4, 4, 4, 4]
    assert per_worker(split, "job")["weight_fetch_jobs"] == [6, 6, 6, 6]
    with pytest.raises(LoweringError, match="prefetch=-1"):
        lower(tl, "job", -1)


@pytest.mark.parametrize("cache", ["step", "job"])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name,G,R,S,B", SCHEMES)
def test_plan_matches_simulator(name, G, R, S, B, order, split, cache):
    plan = lower(simulate(make_schedule(name, S, B, G=G, R=R, order=order, split_backward=split)), cache)
    counts, pred = plan.counts(), predicted_receives(plan)
    assert counts[ACT] == pred[ACT] and counts[GRAD] == pred[GRAD] and counts[WEIGHTS] == pred[WEIGHTS]
    p = plan.predicted
    sent_wgrad = [sum(len(r.send_to_owner) for r in prog.reduces) for prog in plan.programs]
    assert sent_wgrad == p["weight_grad_send"]
    replicated = [sum(1 for r in prog.reduces if r.replicas) for prog in plan.programs]
    assert replicated == p["weight_allreduce"]
    assert [len(prog.owned) for prog in plan.programs] == p["weights_owned"]
    _check_weights(plan)
    if cache == "job":  # named schemes: with no lookahead the engine holds what the simulator says
        tl = plan.timeline
        assert lower(tl, cache, 0).predicted["weights_peak_resident"] == per_worker(tl, cache)["weights_peak_resident"]
    # both ends of every pair list the same messages in the same order, sorted by key
    for w, prog in enumerate(plan.programs):
        for peer, q in prog.pair_order.items():
            assert q == plan.programs[peer].pair_order[w]
            assert [plan.messages[m].key for m in q] == sorted(plan.messages[m].key for m in q)
    execute_abstract(plan)


def test_identities_lower_alike():
    """LPP with G=1, R=S is GPipe and LPP with G=B, R=1 is DDP: same messages."""
    def sig(plan: Lowered):
        return [(m.kind, m.src, m.dst, m.stage, m.microbatch) for m in plan.messages]
    assert (sig(lower(simulate(make_schedule("lpp", 4, 6, G=1, R=4))))
            == sig(lower(simulate(make_schedule("gpipe", 4, 6, G=1, R=4)))))
    assert (sig(lower(simulate(make_schedule("lpp", 3, 4, G=4, R=1))))
            == sig(lower(simulate(make_schedule("ddp", 3, 4, G=4, R=1)))))


def test_ddp_all_reduces_every_stage_among_all_workers():
    """DDP sends no message at all: every stage is all-reduced by its four replicas."""
    plan = lower(simulate(make_schedule("ddp", 3, 4, G=4, R=1)))
    assert plan.messages == []
    for prog in plan.programs:
        assert [(r.stage, r.replicas) for r in prog.reduces] == [(s, (0, 1, 2, 3)) for s in range(3)]


def test_partial_sums_go_out_after_the_last_job_that_adds_to_them():
    """FSDP: a worker's weight-gradient sum for another owner is sent by its last backward of
    that stage, keyed at that job's finish, not at the end of the step."""
    tl = simulate(make_schedule("fsdp", 4, 4, G=4, R=1))
    plan = lower(tl)
    wgrads = [m for m in plan.messages if m.kind == WGRAD]
    assert wgrads
    for m in wgrads:
        op = plan.programs[m.src].jobs[_sent_after(plan.programs[m.src])[m.mid]]
        assert op.stage == m.stage and op.owner == m.dst and op.kind == "B"
        later = [o for o in plan.programs[m.src].jobs if o.start > op.start]
        assert not any(o.stage == m.stage and o.owner == m.dst and o.kind == "B" for o in later)
        assert m.key[0] == tl.finish[op.job] < tl.latency or m.key[0] == tl.latency


def test_rejects_forward_and_backward_apart():
    def apart(s, b, d):
        return (0, 0 if d == "F" else 1)

    step = make_schedule(apart, 2, 2)
    step.workers = 2
    with pytest.raises(LoweringError, match=r"runs F\(0,0\) on worker 0 but B\(0,0\) on worker 1"):
        lower(simulate(step))


def test_rejects_bad_weight_cache():
    with pytest.raises(LoweringError, match="weight_cache='never'"):
        lower(simulate(make_schedule("gpipe", 2, 2, G=1, R=2)), "never")


@st.composite
def custom(draw):
    W = draw(st.integers(1, 5))
    S = draw(st.integers(1, 6))
    B = draw(st.integers(1, 6))
    comp = draw(st.lists(st.integers(0, W - 1), min_size=S * B, max_size=S * B))
    own = draw(st.lists(st.integers(0, W - 1), min_size=3 * S * B, max_size=3 * S * B))
    split = draw(st.booleans())
    order = draw(st.sampled_from(ORDERS))
    cache = draw(st.sampled_from(["step", "job"]))
    kinds = {"F": 0, "B": 1, "I": 1, "W": 2}

    def place(s, b, d):
        return (own[(kinds[d] * S + s) * B + b], comp[s * B + b])

    step = make_schedule(place, S, B, order=order, split_backward=split)
    step.workers = W
    return step, cache, draw(st.integers(0, 4))


@settings(max_examples=150, deadline=None)
@given(custom())
def test_any_colocated_placement_lowers_and_cannot_deadlock(sc):
    step, cache, prefetch = sc
    try:
        tl = simulate(step)
    except ScheduleError:  # 1F1B's warm-up limit can strand an arbitrary placement: refused, not run
        assume(False)
    plan = lower(tl, cache, prefetch)
    counts, pred = plan.counts(), predicted_receives(plan)
    assert counts[ACT] == pred[ACT] and counts[GRAD] == pred[GRAD] and counts[WEIGHTS] == pred[WEIGHTS]
    _check_weights(plan)
    execute_abstract(plan)


def test_abstract_executor_catches_a_bad_pair_order():
    """Gradients put ahead of activations on a pair (both ends agree) would hang NCCL: detected."""
    plan = lower(simulate(make_schedule("gpipe", 2, 3, G=1, R=2)))
    for w, peer in ((0, 1), (1, 0)):
        q = plan.programs[w].pair_order[peer]
        q.sort(key=lambda m: plan.messages[m].kind != GRAD)
    with pytest.raises(AssertionError, match="deadlock under NCCL ordering"):
        execute_abstract(plan)


@pytest.mark.parametrize("cache", ["step", "job"])
@pytest.mark.parametrize("name,G,R,S,B", SCHEMES)
def test_weight_messages_are_the_lowered_programs_weight_traffic(name, G, R, S, B, cache):
    """What the planner charges a job for weight messages (on CPU workers each costs a core's time)
    is what the lowered programs move at it: a copy received before it, a copy its owner hands
    over before it (after the owner's last job: at that job), a partial sum sent after it."""
    tl = simulate(make_schedule(name, S, B, G=G, R=R, order="1f1b"))
    plan = lower(tl, weight_cache=cache, prefetch=0)  # no lookahead: each hand-over at its release point
    want = [0] * tl.schedule.space.N
    for prog in plan.programs:
        seen: set[int] = set()
        for i, op in enumerate(prog.jobs):
            if op.weights_mid is not None and op.weights_mid not in seen:
                seen.add(op.weights_mid)
                want[op.job] += 1
        for i in _sent_after(prog).values():
            want[prog.jobs[i].job] += 1
        for (kind, _), i in zip(prog.ops, _gaps(prog)):
            if kind == SEND_WEIGHTS:
                want[prog.jobs[min(i, len(prog.jobs) - 1)].job] += 1
    assert want == weight_messages(tl, cache)
    assert any(want) == (name in ("fsdp", "fslpp"))


def _sent_after(prog) -> dict[int, int]:
    """Per partial sum the program sends (``SEND_WGRAD``), the index of the job it goes out after."""
    out, i = {}, -1
    for kind, arg in prog.ops:
        if kind in COMPUTE:
            i = arg
        elif kind == SEND_WGRAD:
            out[arg] = i
    return out


def _gaps(prog) -> list[int]:
    """Per operation, the job it stands before (a job: itself; after the last job: the job count)."""
    out, i = [], 0
    for kind, arg in prog.ops:
        out.append(arg if kind in COMPUTE else i)
        i = arg + 1 if kind in COMPUTE else i
    return out


@pytest.mark.parametrize("prefetch", [0, 1, 2, 5])
@pytest.mark.parametrize("cache", ["step", "job"])
def test_the_lookahead_is_resolved_to_positions_in_the_program(prefetch, cache):
    """With lookahead ``prefetch`` a receive stands ``prefetch`` jobs ahead of the job it feeds and
    an owner's hand-over ``prefetch`` jobs ahead of its release point (at the start at the
    earliest): what the replay's weight arrivals (lowering.weight_arrivals) read from ``early``."""
    tl = simulate(make_schedule("fslpp", 4, 4, G=2, R=2, order="zb_h1", split_backward=True))
    plain, ahead = lower(tl, cache, 0), lower(tl, cache, prefetch)
    assert plain.messages == ahead.messages
    moved = (RECV_ACT, RECV_GRAD, RECV_WEIGHTS, SEND_WEIGHTS)
    assert any(k == SEND_WEIGHTS for p in plain.programs for k, _ in p.ops)
    for p0, p in zip(plain.programs, ahead.programs):
        at0 = {(k, a): g for (k, a), g in zip(p0.ops, _gaps(p0)) if k in moved}
        at = {(k, a): g for (k, a), g in zip(p.ops, _gaps(p)) if k in moved}
        assert at.keys() == at0.keys()
        assert all(at[key] == early(g, prefetch) for key, g in at0.items())
        assert [op for op in p.ops if op[0] not in moved] == [op for op in p0.ops if op[0] not in moved]


@pytest.mark.parametrize("scheme,G,R,split,cache", [("ddp", 4, 1, False, "step"), ("fsdp", 4, 1, True, "job"),
                                                    ("lpp", 2, 2, False, "step"), ("fslpp", 2, 2, True, "job")])
def test_frozen_stages_send_no_gradient(scheme: str, G: int, R: int, split: bool, cache: str) -> None:
    """A stage with nothing to train (``Schedule.frozen``) has no partial sum and no all-reduce; the
    rest of the program, and the counts the simulator predicts, follow."""
    from dataclasses import replace

    step = make_schedule(scheme, 4, 4, G=G, R=R, split_backward=split)
    every, some = lower(simulate(step), cache), lower(simulate(replace(step, frozen=frozenset({0, 3}))), cache)
    wgrad = [m for m in some.messages if m.kind == WGRAD]
    assert not any(m.stage in (0, 3) for m in wgrad)
    assert sorted((m.src, m.dst, m.stage) for m in wgrad) == sorted(
        (m.src, m.dst, m.stage) for m in every.messages if m.kind == WGRAD and m.stage not in (0, 3))
    for w, prog in enumerate(some.programs):
        assert [r.stage for r in prog.reduces if r.replicas] == [
            r.stage for r in every.programs[w].reduces if r.replicas and r.stage not in (0, 3)]
        assert some.predicted["weight_grad_send"][w] == sum(m.src == w for m in wgrad)
        assert some.predicted["weight_allreduce"][w] == sum(1 for r in prog.reduces if r.replicas)
    assert set(some.reduce_order) == set(every.reduce_order) - {0, 3}
    assert [m.kind for m in some.messages if m.kind != WGRAD] == [m.kind for m in every.messages if m.kind != WGRAD]


@pytest.mark.parametrize("cache", ["step", "job"])
@pytest.mark.parametrize("name,G,R,S,B", SCHEMES)
def test_a_send_starts_only_at_a_send(name, G, R, S, B, cache):
    """Walking a worker's operations as the engine does (PairIssue, the rule its communication
    follows), asking for a receive never starts a send: every send goes out at a send of the
    program (its own, or one held behind it in the pair's order), and all of them by the end."""
    plan = lower(simulate(make_schedule(name, S, B, G=G, R=R, order="1f1b")), cache, 2)
    for prog in plan.programs:
        issue = PairIssue(plan.messages, prog.worker, prog.pair_order)
        started: set[int] = set()
        for n, (kind, arg) in enumerate(prog.ops):
            if kind in SENDS:
                started |= {m for m in issue.ready(arg) if plan.messages[m].src == prog.worker}
            elif kind in (RECV_ACT, RECV_GRAD, RECV_WEIGHTS) or kind == RECV_WGRAD and n < prog.tail:
                assert all(plan.messages[m].dst == prog.worker for m in issue.want(arg))
        assert started == {m.mid for m in plan.messages if m.src == prog.worker}
