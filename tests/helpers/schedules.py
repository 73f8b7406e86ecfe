"""Independent checks of a simulated timeline, and random steps to run them on (hypothesis).

Nothing here trusts the simulator's own bookkeeping: every invariant is recomputed from
``start``/``finish``/``compute`` and the job space's ``pred``.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import strategies as st

from launcher.schedule import StageGraph, make_schedule
from launcher.schedule.activations import unit_peaks
from launcher.schedule.simulate import Timeline


def live_intervals(tl: Timeline) -> list[tuple[int, float, float]]:
    """``(worker, start, end)`` of every stashed activation ``x_s^b``.

    ``x_s^b`` is held by the worker of ``F(s,b)`` from that job's start to the end of the backward
    that consumes it (``B``, or ``I`` when the backward is split).
    """
    space = tl.schedule.space
    SB = space.S * space.microbatches
    return [(tl.compute[j], tl.start[j], tl.finish[j + SB]) for j in range(SB)]


def peak_live(tl: Timeline) -> list[int]:
    """Peak live activations per worker; a release at time t happens before an acquire at t."""
    events: list[list[tuple[float, int]]] = [[] for _ in range(tl.schedule.workers)]
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
    step, space = tl.schedule, tl.schedule.space
    N, W = space.N, step.workers
    comm = float(step.comm)

    # every job runs exactly once, on its w_compute, for its duration
    ran = Counter(j for prog in tl.sequences for j in prog)
    assert sorted(ran) == list(range(N)) and set(ran.values()) == {1} if N else not ran, (
        f"jobs that did not run exactly once: {sorted(j for j in range(N) if ran[j] != 1)[:5]}"
    )
    for w, prog in enumerate(tl.sequences):
        for j in prog:
            assert tl.compute[j] == w, f"job {space.job(j)} placed on {tl.compute[j]} ran on {w}"
    for j in range(N):
        s, b, d = space.job(j)
        ww, wc = step.placement(s, b, d)
        assert (tl.owner[j], tl.compute[j]) == (ww, wc), f"job {space.job(j)} misplaced"
        want = float(step.durations[d])
        assert abs(tl.finish[j] - tl.start[j] - want) < 1e-9, (
            f"job {space.job(j)} ran {tl.finish[j] - tl.start[j]}, not {want}")

    # no job starts before its predecessors end (plus comm when the edge crosses workers)
    for j in range(N):
        for p in space.pred(j):
            need = tl.finish[p] + (comm if tl.compute[p] != tl.compute[j] else 0.0)
            assert tl.start[j] >= need - 1e-9, (
                f"{space.job(j)} starts at {tl.start[j]} before its predecessor {space.job(p)} "
                f"(on w{tl.compute[p]}) allows, at {need}"
            )

    # no worker runs two jobs at once; a worker's program is in start order
    for w, prog in enumerate(tl.sequences):
        for a, b in zip(prog, prog[1:]):
            assert tl.start[b] >= tl.finish[a] - 1e-9, (
                f"worker {w} runs {space.job(a)} [{tl.start[a]}, {tl.finish[a]}) and "
                f"{space.job(b)} [{tl.start[b]}, {tl.finish[b]}) at once"
            )

    # peak activations: the simulator's count of live inputs equals the recount, and the units of the
    # one memory model (inputs to I, graphs to W) respect the limit
    peak = peak_live(tl)
    assert list(tl.peak_activations) == peak, f"peak_activations {tl.peak_activations} != recount {peak}"
    ml = step.memory_limit
    if ml is not None:
        limits = [ml] * W if isinstance(ml, int) else list(ml)
        units = unit_peaks(tl)
        for w in range(W):
            assert units[w] <= limits[w] + 1e-9, f"worker {w} holds {units[w]} units over its limit {limits[w]}"


def ready_time(tl: Timeline, j: int) -> float:
    space, comm = tl.schedule.space, float(tl.schedule.comm)
    r = 0.0
    for p in space.pred(j):
        r = max(r, tl.finish[p] + (comm if tl.compute[p] != tl.compute[j] else 0.0))
    return r


def check_greedy(tl: Timeline) -> None:
    """Without memory limits, a worker never idles while one of its jobs is ready."""
    space = tl.schedule.space
    for w, prog in enumerate(tl.sequences):
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


# ---- random steps: every named placement and random custom ones, every order -------------------

SCHEMES = ("ddp", "fsdp", "gpipe", "lpp", "fslpp")
ORDERS = ("1f1b", "1f1b/none", "breadth_first", "depth_first", "custom")
HALVES = st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0])  # exact in binary: comparisons stay exact


@st.composite
def graphs(draw, S):
    """A chain most of the time, else a random DAG on S stages (edges go upward)."""
    if S == 1 or draw(st.booleans()):
        return StageGraph.chain(S)
    preds = [()]
    for s in range(1, S):
        ps = draw(st.sets(st.integers(0, s - 1), min_size=1, max_size=min(2, s)))
        preds.append(tuple(sorted(ps)))
    return StageGraph(tuple(preds))


@st.composite
def placements(draw, S, B):
    """``(strategy, G, R)``: a named scheme with its worker count, or a random table on W workers."""
    which = draw(st.sampled_from(SCHEMES + ("random",)))
    if which in ("ddp", "fsdp"):
        return which, B, 1
    if which == "gpipe":
        return which, 1, S
    if which in ("lpp", "fslpp"):  # within the rules every entry point checks: G <= B, R <= S
        return which, draw(st.integers(1, min(5, B))), draw(st.integers(1, min(5, S)))
    W = draw(st.integers(1, min(6, B)))
    kinds = ("F", "B", "I", "W")
    table = {
        (s, b, d): (draw(st.integers(0, W - 1)), draw(st.integers(0, W - 1)))
        for s in range(S) for b in range(B) for d in kinds
    }

    def random_placement(s, b, d):
        return table[(s, b, d)]

    return random_placement, W, 1


@st.composite
def steps(draw, max_S=10, max_B=10):
    S = draw(st.integers(1, max_S))
    B = draw(st.integers(1, max_B))
    strategy, G, R = draw(placements(S, B))
    split = draw(st.booleans())
    graph = draw(graphs(S))
    o = draw(st.sampled_from(ORDERS))
    warmup = None
    if o == "1f1b/none":
        o, warmup = "1f1b", "none"
    elif o == "custom":
        keys = draw(st.permutations(range(3 * S * B)))

        def n(s, b, d):
            return keys[("FBIW".index(d) % 3 * S + s) * B + b]

        o = n
    durations = {"F": draw(HALVES), "B": draw(HALVES), "I": draw(HALVES), "W": draw(HALVES)}
    comm = draw(st.sampled_from([0.0, 0.0, 0.5, 1.0]))
    W = G * R
    limit = draw(st.one_of(
        st.none(),
        st.integers(1, S + 2),
        st.lists(st.integers(1, S + 2), min_size=W, max_size=W),
    ))
    return make_schedule(strategy, S, B, G, R, order=o, warmup=warmup, durations=durations, comm=comm,
                     memory_limit=limit, split_backward=split, graph=graph)
