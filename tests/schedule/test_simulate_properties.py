"""Property tests of the greedy simulator over random steps (hypothesis).

Random S, B, G, R, every named placement plus random custom ones, every order (and a random custom
one), random durations, communication delay, split backward, stage DAGs and memory limits. On every
timeline: each job runs exactly once, no job starts before its predecessors end (plus ``comm``
across workers), no worker runs two jobs at once, and no worker ever holds more activations than
its limit (see :mod:`helpers.schedules` for the random steps and the checks, recomputed from the
timeline).
"""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.schedules import SCHEMES, check_greedy, check_timeline, steps
from launcher.schedule import ScheduleError, make_schedule, simulate

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(steps())
def test_every_timeline_is_valid(step):
    try:
        tl = simulate(step)
    except ScheduleError:
        # only a limit may refuse: a memory limit (checked up front, or a dead end found while
        # running), or 1F1B's warm-up, whose in-flight limit can strand an arbitrary placement
        assert step.memory_limit is not None or step.order.warmup == "classic"
        return
    check_timeline(tl)


@SETTINGS
@given(steps())
def test_without_limits_no_worker_idles_while_a_job_of_its_own_is_ready(step):
    step.memory_limit = None
    step.order = dataclasses.replace(step.order, warmup="none")
    tl = simulate(step)
    check_timeline(tl)
    check_greedy(tl)


@settings(max_examples=60, deadline=None)
@given(
    S=st.integers(1, 10), B=st.integers(1, 10), G=st.integers(1, 4), R=st.integers(1, 4),
    scheme=st.sampled_from(SCHEMES), o=st.sampled_from(("1f1b", "breadth_first", "depth_first")),
)
def test_classic_warmup_never_deadlocks_the_named_schemes(S, B, G, R, scheme, o):
    """The 1F1B warm-up limit alone (no M) always lets the named schemes finish."""
    if scheme in ("ddp", "fsdp"):
        G, R = B, 1
    elif scheme == "gpipe":
        G, R = 1, S
    G, R = min(G, B), min(R, S)  # the rules every entry point checks
    tl = simulate(make_schedule(scheme, S, B, G, R, order=o, warmup="classic"))
    check_timeline(tl)


@settings(max_examples=80, deadline=None)
@given(
    S=st.integers(1, 8), B=st.integers(1, 8), G=st.integers(1, 4), R=st.integers(1, 4),
    scheme=st.sampled_from(SCHEMES), o=st.sampled_from(("1f1b", "breadth_first", "depth_first")),
    warmup=st.sampled_from(("classic", "none")), extra=st.integers(0, 2), split=st.booleans(),
)
def test_every_limit_the_up_front_check_accepts_finishes_the_named_schemes(S, B, G, R, scheme, o, warmup, extra,
                                                                            split):
    """A memory limit is refused before the run or the step finishes: admission reserves a
    micro-batch's whole need on a worker, so greedy starts cannot strand one another."""
    if scheme in ("ddp", "fsdp"):
        G, R = B, 1
    elif scheme == "gpipe":
        G, R = 1, S
    G, R = min(G, B), min(R, S)
    probe = make_schedule(scheme, S, B, G, R)
    tl0 = simulate(probe)
    per_mb = {}
    for s in range(S):
        for b in range(B):
            key = (tl0.compute[probe.space.id(s, b, "F")], b)
            per_mb[key] = per_mb.get(key, 0) + 1
    M = max(per_mb.values()) + extra  # the smallest limit the up-front check accepts, and a little more
    tl = simulate(make_schedule(scheme, S, B, G, R, order=o, warmup=warmup, memory_limit=M, split_backward=split))
    check_timeline(tl)
    assert max(tl.peak_activations) <= M


def test_a_release_from_another_worker_does_not_start_a_second_job_on_a_busy_worker():
    """Regression: x_s^b freed by a backward on another worker woke its (busy) holder early.

    Forwards on worker 0, backwards on worker 1, F slower than B: B(1,0) on w1 ends at 7 and frees
    x_1^0 on w0, which is then running F(0,1) in [6, 9); w0 must not start F(0,2) at 7.
    """

    def forwards_here_backwards_there(s, b, d):
        w = 0 if d == "F" else 1
        return (w, w)

    step = make_schedule(forwards_here_backwards_there, 2, 3, G=2, R=1, order="1f1b", warmup="none",
                     durations={"F": 3, "B": 1})
    check_timeline(simulate(step))
