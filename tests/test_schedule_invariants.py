"""Independent checks of a simulated timeline, shared by the schedule tests (imported from here by the other test modules).

Nothing here trusts the simulator's own bookkeeping: every invariant is recomputed from
``start``/``finish``/``compute`` and the job space's ``pred``.
"""

from __future__ import annotations

from collections import Counter

from launcher.schedule.simulate import Timeline


def live_intervals(tl: Timeline) -> list[tuple[int, float, float]]:
    """``(worker, start, end)`` of every stashed activation ``x_s^b``.

    ``x_s^b`` is held by the worker of ``F(s,b)`` from that job's start to the end of the backward
    that consumes it (``B``, or ``I`` when the backward is split).
    """
    space = tl.step.space
    SB = space.S * space.B
    return [(tl.compute[j], tl.start[j], tl.finish[j + SB]) for j in range(SB)]


def peak_live(tl: Timeline) -> list[int]:
    """Peak live activations per worker; a release at time t happens before an acquire at t."""
    events: list[list[tuple[float, int]]] = [[] for _ in range(tl.step.workers)]
    for w, a, b in live_intervals(tl):
        events[w].append((a, 1))
        events[w].append((b, -1))
    out = []
    for ev in events:
        live = peak = 0
        for _, d in sorted(ev):  # (-1) sorts before (+1) at equal times
            live += d
            peak = max(peak, live)
        out.append(peak)
    return out


def check_timeline(tl: Timeline) -> None:
    """Assert every invariant of a valid schedule; raise AssertionError with the culprit."""
    step, space = tl.step, tl.step.space
    N, W = space.N, step.workers
    comm = float(step.comm)

    # every job runs exactly once, on its w_compute, for its duration
    ran = Counter(j for prog in tl.program for j in prog)
    assert sorted(ran) == list(range(N)) and set(ran.values()) == {1} if N else not ran, (
        f"jobs that did not run exactly once: {sorted(j for j in range(N) if ran[j] != 1)[:5]}"
    )
    for w, prog in enumerate(tl.program):
        for j in prog:
            assert tl.compute[j] == w, f"job {space.job(j)} placed on {tl.compute[j]} ran on {w}"
    for j in range(N):
        s, b, d = space.job(j)
        ww, wc = step.placement(s, b, d)
        assert (tl.weights[j], tl.compute[j]) == (ww, wc), f"job {space.job(j)} misplaced"
        want = float(step.durations[d])
        assert abs(tl.finish[j] - tl.start[j] - want) < 1e-9, f"job {space.job(j)} ran {tl.finish[j] - tl.start[j]}, not {want}"

    # no job starts before its predecessors end (plus comm when the edge crosses workers)
    for j in range(N):
        for p in space.pred(j):
            need = tl.finish[p] + (comm if tl.compute[p] != tl.compute[j] else 0.0)
            assert tl.start[j] >= need - 1e-9, (
                f"{space.job(j)} starts at {tl.start[j]} before its predecessor {space.job(p)} "
                f"(on w{tl.compute[p]}) allows, at {need}"
            )

    # no worker runs two jobs at once; a worker's program is in start order
    for w, prog in enumerate(tl.program):
        for a, b in zip(prog, prog[1:]):
            assert tl.start[b] >= tl.finish[a] - 1e-9, (
                f"worker {w} runs {space.job(a)} [{tl.start[a]}, {tl.finish[a]}) and "
                f"{space.job(b)} [{tl.start[b]}, {tl.finish[b]}) at once"
            )

    # peak activations: the simulator's count equals the recount, and respects the limit
    peak = peak_live(tl)
    assert list(tl.peak_activations) == peak, f"peak_activations {tl.peak_activations} != recount {peak}"
    ml = step.memory_limit
    if ml is not None:
        limits = [ml] * W if isinstance(ml, int) else list(ml)
        for w in range(W):
            assert peak[w] <= limits[w], f"worker {w} holds {peak[w]} activations over its limit {limits[w]}"


def ready_time(tl: Timeline, j: int) -> float:
    space, comm = tl.step.space, float(tl.step.comm)
    r = 0.0
    for p in space.pred(j):
        r = max(r, tl.finish[p] + (comm if tl.compute[p] != tl.compute[j] else 0.0))
    return r


def check_greedy(tl: Timeline) -> None:
    """Without memory limits, a worker never idles while one of its jobs is ready."""
    space = tl.step.space
    for w, prog in enumerate(tl.program):
        busy = sorted((tl.start[j], tl.finish[j]) for j in prog)
        for j in prog:
            r, s = ready_time(tl, j), tl.start[j]
            # [r, s) must be covered by the worker's busy intervals
            t = r
            for a, b in busy:
                if b <= t:
                    continue
                if a > t + 1e-9:
                    break
                t = max(t, b)
                if t >= s:
                    break
            assert t >= s - 1e-9, f"worker {w} idles at {t} while {space.job(j)} is ready (since {r}, started {s})"


# ---- the checker catches what it claims to (so a green property test means something) -------

import copy  # noqa: E402

import pytest  # noqa: E402

from launcher.schedule import make_step, simulate  # noqa: E402


def _tl():
    return simulate(make_step("gpipe", 3, 4, G=1, R=3, order="1f1b", comm=0.5))


def test_checker_accepts_a_valid_timeline():
    check_timeline(_tl())


def test_checker_catches_a_job_that_starts_before_its_predecessor():
    tl = copy.deepcopy(_tl())
    j = tl.step.space.id(1, 0, "F")
    tl.start[j] -= 0.25
    tl.finish[j] -= 0.25
    with pytest.raises(AssertionError, match="before its predecessor"):
        check_timeline(tl)


def test_checker_catches_overlapping_jobs_on_a_worker():
    tl = copy.deepcopy(_tl())
    j = tl.program[0][1]
    tl.start[j] -= 0.5
    tl.finish[j] -= 0.5
    with pytest.raises(AssertionError):
        check_timeline(tl)


def test_checker_catches_a_job_run_twice():
    tl = copy.deepcopy(_tl())
    tl.program[0].append(tl.program[0][0])
    with pytest.raises(AssertionError, match="exactly once"):
        check_timeline(tl)
