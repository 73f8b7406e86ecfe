"""order=interleaved_1f1b: Megatron's interleaved 1F1B, job for job the sequence of PyTorch's
``ScheduleInterleaved1F1B``, deadlock-free on looped pipelines, refused elsewhere, in the planner's
space, and no slower than the 1f1b tie-break on a looped pipeline."""

from __future__ import annotations

import types
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher.plan.space import ORDERS, order_fits
from launcher.schedule import StepError, make_schedule, simulate
from launcher.schedule.cores import replay

pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")


def torch_sequence(R: int, per_worker: int, B: int) -> list[list[tuple[int, int, str]]]:
    """Each rank's ``(stage, microbatch, kind)`` in ``ScheduleInterleaved1F1B``'s order (its own
    computation, without a process group)."""
    rounds = max(1, B // R)
    out = []
    for rank in range(R):
        sched = types.SimpleNamespace(n_local_stages=per_worker, microbatches_per_round=B // rounds,
                                      pp_group_size=R, _n_microbatches=B)
        ops = pipelining.ScheduleInterleaved1F1B._calculate_single_rank_operations(sched, rank)
        forward = pipelining._ComputationType.FORWARD
        out.append([(a.stage_index, a.microbatch_index, "F" if a.computation_type == forward else "B")
                    for a in ops if a is not None])
    return out


# (R, stages per worker, B): B a multiple of R, or below R (PyTorch's one round)
SHAPES = [(2, 2, 8), (2, 2, 4), (2, 2, 2), (4, 2, 8), (4, 2, 16), (4, 2, 4), (2, 3, 8), (3, 2, 9), (2, 4, 8),
          (4, 2, 3)]


@pytest.mark.parametrize("R,per,B", SHAPES)
@pytest.mark.parametrize("durations", [{"F": 1.0, "B": 2.0}, {"F": 1.0, "B": 1.0}, {"F": 1.3, "B": 2.9}])
def test_programs_are_torchs_sequence(R, per, B, durations):
    """Each worker runs exactly PyTorch's sequence, whatever the job times (it waits for its next job)."""
    step = make_schedule("lpp", R * per, B, G=1, R=R, order="interleaved_1f1b", durations=durations, comm=0.1)
    tl = simulate(step)
    got = [[tuple(step.space.job(j)) for j in prog] for prog in tl.sequences]
    assert got == torch_sequence(R, per, B)


@pytest.mark.parametrize("R,per,B", [(2, 2, 8), (4, 2, 8), (2, 3, 8), (4, 2, 16)])
def test_faster_than_the_1f1b_tie_break_when_looped(R, per, B):
    """The bubble the 1f1b tie-break leaves on a looped pipeline (its classic warm-up counts
    micro-batches, not chunks) is gone, with no more activations live on any worker."""
    d = {"F": 1.0, "B": 2.0}
    ours = simulate(make_schedule("lpp", R * per, B, G=1, R=R, order="1f1b", durations=d))
    inter = simulate(make_schedule("lpp", R * per, B, G=1, R=R, order="interleaved_1f1b", durations=d))
    assert inter.latency < ours.latency
    assert all(a <= b for a, b in zip(inter.peak_activations, ours.peak_activations))
    assert replay(inter, R).seconds == inter.latency  # the runtime follows the same sequence


def test_two_stages_per_worker_numbers():
    """The shape of the benchmark (W = 2, two stages each, B = 8), backward twice the forward:
    51 against the 1f1b tie-break's 54 (48 of work per worker)."""
    d = {"F": 1.0, "B": 2.0}
    assert simulate(make_schedule("lpp", 4, 8, G=1, R=2, order="1f1b", durations=d)).latency == 54.0
    assert simulate(make_schedule("lpp", 4, 8, G=1, R=2, order="interleaved_1f1b", durations=d)).latency == 51.0


@settings(max_examples=60, deadline=None)
@given(G=st.integers(1, 3), R=st.integers(2, 4), per=st.integers(2, 3), B=st.integers(1, 12),
       split=st.booleans(), scheme=st.sampled_from(["lpp", "fslpp"]), warmup=st.sampled_from([None, "none"]),
       f=st.floats(0.2, 3.0), b=st.floats(0.2, 3.0), comm=st.sampled_from([0.0, 0.3]))
def test_deadlock_free_on_looped_pipelines(G, R, per, B, split, scheme, warmup, f, b, comm):
    """Every looped shape finishes (several groups, micro-batches that are not a multiple of R,
    the split backward); strictly followed, each worker runs its micro-batches' jobs of its stages."""
    S = R * per
    if G > B:
        return
    d = {"F": f, "B": b, "I": b / 2, "W": b / 2}
    step = make_schedule(scheme, S, B, G=G, R=R, order="interleaved_1f1b", warmup=warmup, durations=d, comm=comm,
                     split_backward=split)
    tl = simulate(step)
    assert sorted(j for prog in tl.sequences for j in prog) == list(range(step.space.N))
    for j in range(step.space.N):
        for p in step.space.pred(j):
            assert tl.finish[p] <= tl.start[j] + 1e-9


@pytest.mark.parametrize("strategy,G,R,S", [("gpipe", 1, 4, 4), ("lpp", 1, 4, 4), ("lpp", 4, 1, 4), ("fsdp", 4, 1, 4),
                                            ("lpp", 1, 2, 5)])
def test_refused_where_not_looped(strategy, G, R, S):
    with pytest.raises(StepError, match=rf"order=interleaved_1f1b is invalid with strategy={strategy} R={R} "
                                        rf"stages={S}: .* needs a looped pipeline"):
        make_schedule(strategy, S, 8 if strategy != "fsdp" else 4, G=G, R=R, order="interleaved_1f1b")


def test_no_effect_under_ddp_runs():
    """DDP has no order to choose (a warning says so): its workers' one micro-batch runs through."""
    tl = simulate(make_schedule("ddp", 4, 4, G=4, R=1, order="interleaved_1f1b"))
    assert tl.latency == simulate(make_schedule("ddp", 4, 4, G=4, R=1)).latency


def test_in_the_planner_space_where_looped():
    assert ("interleaved_1f1b", "classic") in ORDERS
    assert order_fits("interleaved_1f1b", 2, 4, False) and order_fits("interleaved_1f1b", 2, 4, True)
    assert not order_fits("interleaved_1f1b", 4, 4, False) and not order_fits("interleaved_1f1b", 1, 4, False)
    assert not order_fits("interleaved_1f1b", 2, 5, False)
    assert not order_fits("zb_h1", 2, 4, False) and order_fits("zb_h1", 2, 4, True)


def test_the_1f1b_that_runs_is_slower_than_the_1f1b_re_derived():
    """Issue 47: the workers run the programs lowered from the simulation at F = B = 1; timed by the
    per-stage job CPU they measured (GPT d=128, lpp G=1 R=2, 8 micro-batches, ms), 1f1b's program
    takes 16% longer than interleaved_1f1b's, while 1f1b chosen afresh on those times (a sequence
    no worker ran, what issue 36's note compared) is within 7%. Interleaved is a fixed sequence:
    the same either way. Predictions replay the programs that ran (metrics.json, the benchmarks)."""
    per = [{"F": 0.8, "B": 1.2}, {"F": 1.3, "B": 2.3}, {"F": 1.2, "B": 2.1}, {"F": 1.0, "B": 1.4}]
    ran, again = {}, {}
    for o in ("1f1b", "interleaved_1f1b"):
        tl = simulate(make_schedule("lpp", 4, 8, G=1, R=2, order=o))
        timed = replace(tl, schedule=replace(tl.schedule, stage_durations=per))
        ran[o], again[o] = replay(timed, 2).seconds, simulate(timed.schedule).latency
    assert ran["1f1b"] == pytest.approx(58.0) and ran["interleaved_1f1b"] == pytest.approx(50.0)
    assert again["1f1b"] == pytest.approx(53.3) and again["interleaved_1f1b"] == pytest.approx(50.0)


def test_at_two_workers_a_step_is_its_work_plus_the_message_waits_on_its_path():
    """Issue 47: the W=2 interleaved prediction was 7-22% high. The replay (a core per worker) runs
    each worker's program, a job starting ``comm`` after an input from the other worker: on
    Llama d=256's measured per-stage job CPU (ms) it is the busier worker's 143.1 ms of jobs plus
    the message waits on its critical path. metrics.json's ``comm_s`` was 3.72 ms there, taken from
    messages that had sat in their shared-memory slots while the receiver computed (the copy out
    was timed as a wait); a receiver that waited had its data 0.15 ms after the hand-over. At 3.72
    ms the replay is 177.5 ms, 19% above the 149 ms the workers took; at 0.15 ms, 150.1. 1f1b's program
    stays the slower one at either message time."""
    per = [{"F": 2.74, "B": 3.32}, {"F": 5.53, "B": 6.29}, {"F": 4.72, "B": 6.33}, {"F": 2.75, "B": 3.32}]
    step = {}
    for o in ("1f1b", "interleaved_1f1b"):
        tl = simulate(make_schedule("lpp", 4, 8, G=1, R=2, order=o))
        timed = replace(tl, schedule=replace(tl.schedule, stage_durations=per))
        step[o] = {comm: replay(timed, 2, comm=comm).seconds for comm in (0.0, 0.15, 3.72)}
    work = 8 * sum(per[s][k] for s in (1, 3) for k in "FB")  # worker 1's jobs, the busier
    assert work == pytest.approx(143.12)
    inter = step["interleaved_1f1b"]
    assert inter[0.15] == pytest.approx(150.08, abs=0.01) and inter[3.72] == pytest.approx(177.5, abs=0.01)
    assert inter[0.15] - inter[0.0] == pytest.approx(4 * 0.15)  # four message waits on the critical path
    assert all(step["1f1b"][c] > inter[c] for c in inter)
