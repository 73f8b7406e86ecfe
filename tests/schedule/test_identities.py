"""Identities of the unified schedule, on whole timelines (where and when every job ran).

- LPP with G = 1, R = S is GPipe; LPP with G = B, R = 1 is DDP (seed 000, DESIGN.md section 2):
  the same worker, start and finish for every job, the same per-worker programs and peaks, under
  every order, durations, communication delay, memory limit and split backward.
- The seeds' DDP diagram (8 workers, 8 micro-batches, 4 stages) cell for cell.
- GPipe's latency is 2(B + S - 1) with F = B = 1 under every order; textbook 1F1B keeps
  min(B, S - s) activations on worker s.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.schedules import check_timeline
from launcher.schedule import ScheduleError, make_schedule, simulate
from launcher.schedule.diagram import ascii_diagram, grid
from launcher.schedule.metrics import summarize

ORDERS = [("1f1b", None), ("1f1b", "none"), ("breadth_first", None), ("depth_first", None),
          ("breadth_first", "classic"), ("depth_first", "classic")]
HALVES = st.sampled_from([0.5, 1.0, 2.0, 3.0])


def whole(tl):
    """Everything a timeline says about where and when each job ran."""
    return {
        "workers": tl.schedule.workers,
        "compute": tl.compute,
        "weights": tl.owner,
        "start": tl.start,
        "finish": tl.finish,
        "program": tl.sequences,
        "peak_activations": tl.peak_activations,
    }


def run_both(a, b):
    """Simulate two steps; both refuse (same reason) or both give the same whole timeline."""
    try:
        ta = simulate(a)
    except ScheduleError as e:
        try:
            simulate(b)
        except ScheduleError as e2:
            assert str(e).split(":")[0] == str(e2).split(":")[0]
            return None
        raise AssertionError(f"only the first step refused: {e}")
    tb = simulate(b)
    check_timeline(ta)
    assert whole(ta) == whole(tb)
    sa, sb = summarize(ta), summarize(tb)
    assert sa["per_worker"] == sb["per_worker"] and sa["latency"] == sb["latency"]
    return ta


variants = st.fixed_dictionaries({
    "order": st.sampled_from(ORDERS),
    "durations": st.fixed_dictionaries({"F": HALVES, "B": HALVES, "I": HALVES, "W": HALVES}),
    "comm": st.sampled_from([0.0, 0.5, 1.0]),
    "memory_limit": st.one_of(st.none(), st.integers(1, 12)),
    "split_backward": st.booleans(),
})


def kw(v):
    o, w = v["order"]
    return dict(order=o, warmup=w, durations=v["durations"], comm=v["comm"],
                memory_limit=v["memory_limit"], split_backward=v["split_backward"])


@settings(max_examples=150, deadline=None)
@given(S=st.integers(1, 10), B=st.integers(1, 10), v=variants)
def test_lpp_with_one_group_of_S_workers_is_gpipe(S, B, v):
    run_both(make_schedule("lpp", S, B, G=1, R=S, **kw(v)), make_schedule("gpipe", S, B, G=1, R=S, **kw(v)))


@settings(max_examples=150, deadline=None)
@given(S=st.integers(1, 10), B=st.integers(1, 10), v=variants)
def test_lpp_with_B_groups_of_one_worker_is_ddp(S, B, v):
    run_both(make_schedule("lpp", S, B, G=B, R=1, **kw(v)), make_schedule("ddp", S, B, G=B, R=1, **kw(v)))


def test_fslpp_with_one_group_of_S_workers_is_gpipe_too():
    """With G = 1, R = S, h(s, s) = h(s, b) = s: FSLPP fetches nothing and is GPipe."""
    for o, w in ORDERS:
        run_both(make_schedule("fslpp", 5, 7, G=1, R=5, order=o, warmup=w),
                 make_schedule("gpipe", 5, 7, G=1, R=5, order=o, warmup=w))


# seed 000's DDP diagram, "v" (the PDF's backward marker) written "b"; 12 columns as printed
SEED_DDP = """\
	1	2	3	4	5	6	7	8	9	10	11	12
w0	f0	f1	f2	f3	v3	v2	v1	v0
w1	f0	f1	f2	f3	v3	v2	v1	v0
w2	f0	f1	f2	f3	v3	v2	v1	v0
w3	f0	f1	f2	f3	v3	v2	v1	v0
w4	f0	f1	f2	f3	v3	v2	v1	v0
w5	f0	f1	f2	f3	v3	v2	v1	v0
w6	f0	f1	f2	f3	v3	v2	v1	v0
w7	f0	f1	f2	f3	v3	v2	v1	v0
"""


def seed_cells(text):
    lines = text.splitlines()
    ncols = len(lines[0].split("\t")) - 1
    rows = []
    for line in lines[1:]:
        cells = [c.replace("v", "b") for c in line.split("\t")[1:]]
        rows.append(cells + [""] * (ncols - len(cells)))
    return rows


def test_ddp_diagram_of_seed_000_cell_for_cell():
    for o, w in ORDERS:
        tl = simulate(make_schedule("ddp", 4, 8, G=8, R=1, order=o, warmup=w))
        cells = grid(tl, "stage")
        want = seed_cells(SEED_DDP)
        assert len(cells) == len(want) == 8
        # the seed prints 12 columns; the step ends after 8, the rest are empty
        assert [r + [""] * (12 - len(r)) for r in cells] == want
        # and micro-batch b is worker b's own, all the way through
        for w_, row in enumerate(grid(tl, "both")):
            assert all(c.endswith(f":{w_}") for c in row)
    text = ascii_diagram(simulate(make_schedule("ddp", 4, 8, G=8, R=1)), cells="stage")
    assert text.splitlines()[1:] == [f"w{w} f0 f1 f2 f3 b3 b2 b1 b0" for w in range(8)]


@settings(max_examples=80, deadline=None)
@given(S=st.integers(1, 12), B=st.integers(1, 12), ow=st.sampled_from(ORDERS))
def test_gpipe_latency_is_2_B_plus_S_minus_1_under_every_order(S, B, ow):
    o, w = ow
    tl = simulate(make_schedule("gpipe", S, B, G=1, R=S, order=o, warmup=w))
    assert tl.latency == 2 * (B + S - 1)
    assert summarize(tl)["latency_fb"] == B + S - 1


@settings(max_examples=80, deadline=None)
@given(S=st.integers(1, 12), B=st.integers(1, 12))
def test_textbook_1f1b_keeps_min_B_S_minus_s_activations_on_worker_s(S, B):
    tl = simulate(make_schedule("gpipe", S, B, G=1, R=S, order="1f1b"))
    # at most min(B, S - s), and the bound is reached
    assert tl.peak_activations == [min(B, S - s) for s in range(S)]


def test_without_the_warmup_1f1b_fills_the_first_stage_until_its_first_backward():
    """The seeds' pure tie-break (warmup=none): worker 0 takes a forward every step until the
    first backward reaches it at 2S - 1, so it holds min(B, 2S - 1) activations, not min(B, S)."""
    for S in range(1, 7):
        for B in range(1, 13):
            tl = simulate(make_schedule("gpipe", S, B, G=1, R=S, order="1f1b", warmup="none"))
            assert tl.peak_activations[0] == min(B, 2 * S - 1)
            assert tl.latency == 2 * (B + S - 1)


def test_diagram_cells_follow_jobs_when_comm_shifts_them_off_the_slot_grid():
    """With comm = 0.3 jobs start between slots; each still shows once per slot it covers, none overwritten."""
    tl = simulate(make_schedule("gpipe", 3, 2, G=1, R=3, order="1f1b", comm=0.3))
    rows = grid(tl, "both")
    for w, prog in enumerate(tl.sequences):
        shown = [c for c in rows[w] if c]
        labels = [f"{k.lower()}{s}:{b}" for s, b, k in (tl.schedule.space.job(j) for j in prog)]
        assert [c for i, c in enumerate(shown) if i == 0 or c != shown[i - 1]] == labels
