"""strategy=vshape and order=zbv: the V-shaped placement, ZB-V job for job the sequence of PyTorch's
``ScheduleZBVZeroBubble`` (each job starting at the time step PyTorch gives it on unit durations),
its peak activations, and the refusals."""

from __future__ import annotations

import types

import pytest

from launcher.schedule import StepError, make_schedule, simulate
from launcher.schedule.placement import VShape

pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")

KIND = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def torch_grid(W: int, B: int) -> list[list[tuple[int, int, str] | None]]:
    """Each rank's ``pipeline_order`` of ``ScheduleZBVZeroBubble`` (computed without a process
    group): one ``(stage, microbatch, kind)`` or idle ``None`` per unit time step."""
    out = []
    for rank in range(W):
        sched = types.SimpleNamespace(pp_group_size=W, _n_microbatches=B, num_stages=2 * W)
        ops = pipelining.ScheduleZBVZeroBubble._calculate_single_rank_operations(sched, rank)
        out.append([None if a is None else (a.stage_index, a.microbatch_index, KIND[a.computation_type.name])
                    for a in ops])
    return out


SHAPES = [(1, 1), (1, 4), (2, 1), (2, 3), (2, 4), (2, 8), (3, 5), (3, 9), (4, 4), (4, 7), (4, 8), (4, 16)]


def zbv(W: int, B: int, **kw):
    return make_schedule("vshape", 2 * W, B, order="zbv", split_backward=True, **kw)


def test_vshape_placement():
    """Worker w holds stages w and 2W - 1 - w: the first and last stages share worker 0."""
    assert [VShape(4)(s, 0, "F") for s in range(8)] == [(w, w) for w in (0, 1, 2, 3, 3, 2, 1, 0)]
    step = make_schedule("vshape", 8, 4)
    assert (step.workers, step.S) == (4, 8)  # G = 1, R = S / 2 from the registry


@pytest.mark.parametrize("W,B", SHAPES)
@pytest.mark.parametrize("durations", [{"F": 1.0, "I": 1.0, "W": 1.0}, {"F": 1.0, "I": 2.0, "W": 1.0},
                                       {"F": 1.3, "I": 2.9, "W": 0.7}])
def test_programs_are_torchs_sequence(W, B, durations):
    """Each worker runs exactly PyTorch's sequence, whatever the job times (it waits for its next job)."""
    tl = simulate(zbv(W, B, durations=durations, comm=0.1))
    got = [[tuple(tl.schedule.space.job(j)) for j in prog] for prog in tl.sequences]
    assert got == [[a for a in ops if a is not None] for ops in torch_grid(W, B)]


@pytest.mark.parametrize("W,B", [(W, B) for W, B in SHAPES if B >= 2 * W - 1])
def test_unit_durations_start_where_torch_puts_them(W, B):
    """On unit durations without communication delay each job starts at its time step in PyTorch's
    ``pipeline_order``, so the step's latency is the longest rank's count of steps (with fewer than
    ``2W - 1`` micro-batches PyTorch leaves the missing ones' steps idle, so only from there on)."""
    tl = simulate(zbv(W, B, durations={"F": 1.0, "I": 1.0, "W": 1.0}, comm=0.0))
    grid = torch_grid(W, B)
    for j in range(tl.schedule.space.N):
        s, b, k = tl.schedule.space.job(j)
        assert grid[tl.compute[j]].index((s, b, k)) == tl.start[j], (s, b, k)
    assert tl.latency == max(len(ops) for ops in grid)


@pytest.mark.parametrize("W", [2, 3, 4])
def test_zero_bubble_on_unit_durations(W):
    """With ``F = I = W`` and enough micro-batches only the pipeline's fill stays idle: each worker
    does its ``6B`` jobs in ``6B + W - 1`` time units (the paper's ZB-V claim)."""
    B = 4 * W
    tl = simulate(zbv(W, B, durations={"F": 1.0, "I": 1.0, "W": 1.0}, comm=0.0))
    assert tl.latency == 6 * B + W - 1


@pytest.mark.parametrize("W,B", [(2, 4), (2, 8), (3, 9), (4, 8), (4, 16)])
def test_peak_activations_as_1f1b(W, B):
    """Once ``B >= 2W - 1`` every worker keeps at most ``2W`` stage activations, half a model's
    each: ``W`` micro-batches' worth of activations, 1F1B's peak on ``W`` workers (the paper's
    memory claim), and exactly that on every worker."""
    tl = simulate(zbv(W, B))
    assert tl.peak_activations == [2 * W] * W
    one = simulate(make_schedule("gpipe", W, B, order="1f1b"))
    assert max(one.peak_activations) == W  # 1F1B's peak: W micro-batches of whole-worker stages


def test_refused_elsewhere():
    """order=zbv needs vshape and the split backward; vshape needs stages = 2W with G = 1."""
    with pytest.raises(StepError, match="order=zbv is invalid with strategy=lpp"):
        make_schedule("lpp", 4, 4, G=1, R=2, order="zbv", split_backward=True)
    with pytest.raises(ValueError, match="needs split_backward=True"):
        make_schedule("vshape", 4, 4, order="zbv")
    with pytest.raises(StepError, match="strategy=vshape with G=1 R=3 stages=4 is invalid"):
        make_schedule("vshape", 4, 4, G=1, R=3)
    with pytest.raises(StepError, match="give it an even number of stages"):
        make_schedule("vshape", 5, 4, G=1, R=2)
    with pytest.raises(StepError, match="set G=1 R=2"):
        make_schedule("vshape", 4, 4, G=2, R=1)


def test_not_in_the_planners_hashed_space():
    """The planner's hashed points share the looped hash's compute placement; the V shape's is
    another, planned as a placement of its own (even S on S/2 workers)."""
    from launcher.plan.space import order_fits, schemes_at, vshape_fits

    assert "vshape" not in [v.name for v in schemes_at(1, 2, 4, 4)]
    assert vshape_fits(2, 4, 4) and not vshape_fits(1, 4, 4) and not vshape_fits(4, 5, 4)
    assert order_fits("zbv", 2, 4, True, vshape=True) and not order_fits("zbv", 2, 4, True)
    assert not order_fits("zbv", 2, 4, False, vshape=True)
    assert not order_fits("interleaved_1f1b", 2, 4, True, vshape=True)


def test_config_group():
    """``conf/strategy/vshape.yaml`` takes G and R from the registry; ``conf/order/zbv.yaml`` names
    the order (composed from this checkout's ``conf/``)."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    import launcher.config  # noqa: F401  (registers the schema and the resolver)
    from launcher.config import errors, to_schedule

    with initialize_config_dir(str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["strategy=vshape", "stages=8", "microbatches=8", "order=zbv",
                                           "split_backward=true"])
        assert errors(cfg) == []
        step = to_schedule(cfg)
        assert (cfg.G, cfg.R, step.workers, step.order.name) == (1, 4, 4, "zbv")
        unsplit = compose("config", overrides=["strategy=vshape", "stages=8", "order=zbv"])
        assert errors(unsplit) == [
            "split_backward=false is invalid with order=zbv: it runs the weight-gradient "
            "jobs W apart, which exist only when the backward is split; leave split_backward at true."]
