"""Workers sharing cores (launcher.schedule.cores): the replay of the simulated programs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher.schedule import make_schedule, simulate
from launcher.schedule.cores import replay
from launcher.schedule.lowering import weight_arrivals


@st.composite
def steps(draw):
    S, B = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    scheme = draw(st.sampled_from(["ddp", "fsdp", "gpipe", "lpp", "fslpp"]))
    G, R = {"ddp": (B, 1), "fsdp": (B, 1), "gpipe": (1, S)}.get(
        scheme, (draw(st.integers(1, B)), draw(st.integers(1, S))))
    split = draw(st.booleans())
    durations = {k: draw(st.floats(0.1, 3.0)) for k in "FBIW"} | {"I": 0.6}
    return make_schedule(scheme, S, B, G=G, R=R, order=draw(st.sampled_from(["1f1b", "breadth_first", "depth_first"])),
                     warmup="none", split_backward=split, comm=draw(st.sampled_from([0.0, 0.25])), durations=durations)


@settings(max_examples=150, deadline=None)
@given(steps())
def test_a_core_each_reproduces_the_simulated_timeline(step):
    tl = simulate(step)
    assert replay(tl, step.workers).seconds == pytest.approx(tl.latency)
    assert replay(tl, 10 * step.workers).seconds == pytest.approx(tl.latency)


@settings(max_examples=150, deadline=None)
@given(steps(), st.integers(1, 4))
def test_fewer_cores_take_longer_and_never_beat_the_work(step, cores):
    tl = simulate(step)
    work = sum(tl.finish[j] - tl.start[j] for j in range(step.space.N))
    t, busy, start, finish = replay(tl, cores)
    assert t >= tl.latency - 1e-9  # sharing never helps
    assert t >= work / min(cores, step.workers) - 1e-9  # the cores cannot do more than their share
    assert sum(busy) >= work - 1e-9  # a worker's jobs take at least their work, longer when it shares
    for w, prog in enumerate(tl.sequences):  # each worker runs its program in order, one job at a time
        for a, b in zip(prog, prog[1:]):
            assert start[a] < finish[a] <= start[b] + 1e-12
        for j in prog:
            assert all(finish[p] <= start[j] + 1e-12 for p in step.space.pred(j))


def test_two_independent_workers_on_one_core_share_it():
    tl = simulate(make_schedule("ddp", 1, 2, G=2, R=1, durations={"F": 1.0, "B": 2.0}))
    assert tl.latency == pytest.approx(3.0)
    seconds, busy, _, _ = replay(tl, 1)
    assert seconds == pytest.approx(6.0) and busy == pytest.approx([6.0, 6.0])  # both at half speed throughout
    # a tail after the jobs, which waits for the partner, then a delay before it
    assert replay(tl, 2, tails=[1.0, 0.5], sync=[[1], [0]], delays=[0.5, 0.5]).seconds == pytest.approx(4.5)


def test_a_memory_limit_is_the_order_it_leaves():
    # the runtime runs each worker's program in order without waiting for memory: the replay does too
    tl = simulate(make_schedule("gpipe", 4, 8, G=1, R=4, order="1f1b"))
    assert replay(tl, 4).seconds <= tl.latency + 1e-9


@settings(max_examples=100, deadline=None)
@given(steps(), st.lists(st.floats(0.0, 2.0), min_size=8, max_size=8), st.booleans(), st.sampled_from(["step", "job"]),
       st.integers(0, 2))
def test_a_core_each_is_the_sharing_loop_at_full_rate(step, extra, synced, cache, prefetch):
    # ``cores >= W`` takes a one-pass longest-path route; just under W cores the sharing loop runs,
    # at a rate that differs from 1 by 1e-12: both must give the same times, weight copies included
    tl = simulate(step)
    W = step.workers
    tails, delays = extra[:W] if W <= 8 else None, extra[::-1][:W] if W <= 8 else None
    sync = [list(range(W))] * W if synced else None
    fetched = weight_arrivals(tl, cache, prefetch)
    fast = replay(tl, W, tails, sync, delays, fetched=fetched)
    loop = replay(tl, W * (1 - 1e-12), tails, sync, delays, fetched=fetched)
    assert fast.seconds == pytest.approx(loop.seconds, rel=1e-9, abs=1e-9)
    assert fast.finish == pytest.approx(loop.finish, rel=1e-9, abs=1e-9)
    assert fast.busy == pytest.approx(loop.busy, rel=1e-9, abs=1e-9)


def test_a_weight_copy_arrives_a_message_after_its_owner_hands_it_over():
    """FSDP on two workers: worker 1's first forward runs on stage 0's weights, which worker 0 owns
    and hands over at the start of the step (before its first job), so it waits a message's time;
    with no lookahead an owner hands a copy over later, never sooner."""
    tl = simulate(make_schedule("fsdp", 2, 2, G=2, R=1, comm=0.5, durations={"F": 1.0, "B": 2.0}))
    assert tl.start[tl.sequences[1][0]] == 0.0  # the simulator lets weight copies wait for nothing
    fetched = weight_arrivals(tl, "step", 1)
    assert fetched[tl.sequences[1][0]] == -1
    assert replay(tl, 2, fetched=fetched).start[tl.sequences[1][0]] == pytest.approx(0.5)
    late = weight_arrivals(tl, "step", 0)
    assert all(p == -1 or tl.compute[p] == tl.owner[j] != tl.compute[j] for j, p in late.items())  # the owner's job
    assert replay(tl, 2, fetched=late).seconds >= replay(tl, 2, fetched=fetched).seconds - 1e-9
