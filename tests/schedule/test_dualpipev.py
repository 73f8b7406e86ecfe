"""order=dualpipev on strategy=vshape: DualPipeV, job for job PyTorch's ``ScheduleDualPipeV`` (its
full backward as our ``I`` then ``W``, its overlapped forward + backward as the two one after the
other), run by the simulator with every dependency kept, its unit-time step and peak activations
against ZB-V's, and the refusals."""

from __future__ import annotations

import types

import pytest

from launcher.schedule import StepError, make_schedule, simulate
from launcher.schedule.lowering import lower
from launcher.schedule.order import dualpipev_sequence
from launcher.schedule.program import whole_backwards
from launcher.schedule.settings import unchecked_schedule
from launcher.schedule.simulate import place_all

pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")

KIND = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
UNIT = {"F": 1.0, "I": 1.0, "W": 1.0}


def expand(action) -> list[tuple[int, int, str]]:
    """One PyTorch action as our ``(stage, microbatch, kind)`` jobs, in the order they run."""
    kind = action.computation_type.name
    if kind == "OVERLAP_F_B":  # PyTorch runs its sub-actions one after the other
        return [job for sub in action.sub_actions for job in expand(sub)]
    s, b = action.stage_index, action.microbatch_index
    if kind == "FULL_BACKWARD":
        return [(s, b, "I"), (s, b, "W")]
    return [(s, b, KIND[kind])]


def torch_actions(W: int, B: int) -> list[list]:
    """Each rank's ``pipeline_order`` of ``ScheduleDualPipeV``, computed without a process group."""
    out = []
    for rank in range(W):
        sched = types.SimpleNamespace(pp_group_size=W, _n_microbatches=B, num_stages=2 * W)
        out.append([a for a in pipelining.ScheduleDualPipeV._calculate_single_rank_operations(sched, rank)
                    if a is not None])
    return out


def torch_sequences(W: int, B: int) -> list[list[tuple[int, int, str]]]:
    """Each rank's ``pipeline_order`` of ``ScheduleDualPipeV``, expanded into our jobs."""
    return [[job for a in ops for job in expand(a)] for ops in torch_actions(W, B)]


def torch_full_backwards(W: int, B: int) -> list[set[tuple[int, int]]]:
    """Per rank, the ``(stage, microbatch)`` that ``ScheduleDualPipeV`` runs as one ``FULL_BACKWARD``
    (alone or inside an ``OVERLAP_F_B``) rather than ``BACKWARD_INPUT`` and ``BACKWARD_WEIGHT``."""
    out = []
    for ops in torch_actions(W, B):
        flat = [sub for a in ops for sub in (a.sub_actions if a.computation_type.name == "OVERLAP_F_B" else (a,))]
        out.append({(a.stage_index, a.microbatch_index) for a in flat if a.computation_type.name == "FULL_BACKWARD"})
    return out


# W = 1..4 workers, B from S = 2W to 3S micro-batches
SHAPES = [(1, 2), (1, 5), (2, 4), (2, 5), (2, 8), (2, 12), (3, 6), (3, 7), (3, 11), (3, 18), (4, 8), (4, 9), (4, 16),
          (4, 24)]


def dualpipev(W: int, B: int, **kw):
    return make_schedule("vshape", 2 * W, B, order="dualpipev", split_backward=True, **kw)


def test_torch_expands_to_every_job_once():
    """The expansion itself loses nothing: each of PyTorch's ranks runs each of its jobs once."""
    for W, B in SHAPES:
        for w, seq in enumerate(torch_sequences(W, B)):
            assert sorted(seq) == sorted((s, b, k) for s in (w, 2 * W - 1 - w) for b in range(B) for k in "FIW")


@pytest.mark.parametrize("W,B", SHAPES)
def test_sequences_are_torchs(W, B):
    """Our per-worker sequences (before any simulation) are PyTorch's, job for job."""
    step = dualpipev(W, B)
    compute, _ = place_all(step)
    seqs = dualpipev_sequence(step.space, compute)
    assert [[tuple(step.space.job(j)) for j in seq] for seq in seqs] == torch_sequences(W, B)


@pytest.mark.parametrize("W,B", SHAPES)
@pytest.mark.parametrize("durations", [UNIT, {"F": 1.0, "I": 2.0, "W": 1.0}, {"F": 1.3, "I": 2.9, "W": 0.7}])
def test_simulator_runs_torchs_sequence(W, B, durations):
    """Each worker runs exactly PyTorch's sequence whatever the job times (it waits for its next
    job), every job once, none before its predecessors finish, one at a time per worker."""
    tl = simulate(dualpipev(W, B, durations=durations, comm=0.1))
    space = tl.schedule.space
    got = [[tuple(space.job(j)) for j in prog] for prog in tl.sequences]
    assert got == torch_sequences(W, B)
    assert sorted(j for prog in tl.sequences for j in prog) == list(range(space.N))
    for j in range(space.N):
        for p in space.pred(j):
            assert tl.start[j] >= tl.finish[p], (space.job(j), space.job(p))
    for prog in tl.sequences:
        assert all(tl.start[b] >= tl.finish[a] for a, b in zip(prog, prog[1:]))


@pytest.mark.parametrize("W,B", [(W, B) for W, B in SHAPES if W > 1])
def test_unit_durations_against_zbv(W, B):
    """On unit ``F = I = W`` without communication delay DualPipeV's step is ZB-V's, ``6B + W - 1``
    (the pipeline's fill only: its gain, overlapping one pair's communication with the other's
    compute, is not in a model where a worker runs one job at a time), and every worker holds one
    stage activation more than ZB-V's ``2W``."""
    tl = simulate(dualpipev(W, B, durations=UNIT, comm=0.0))
    zbv = simulate(make_schedule("vshape", 2 * W, B, order="zbv", split_backward=True, durations=UNIT, comm=0.0))
    assert tl.latency == zbv.latency == 6 * B + W - 1
    assert tl.peak_activations == [2 * W + 1] * W
    assert zbv.peak_activations == [2 * W] * W


@pytest.mark.parametrize("W,B", SHAPES)
def test_no_more_split_backwards_than_torch(W, B):
    """Every backward PyTorch runs whole (``FULL_BACKWARD``) the engine runs whole too
    (:func:`whole_backwards`: its ``I`` and ``W`` as one autograd call), including those whose input
    gradient goes to the other worker: on the simulated step its receiver starts no earlier than
    that ``W`` ends, so sending after the whole backward delays no one. So our workers run no
    more split backwards (two autograd calls, 1.4 times one on a GPT stage) than PyTorch's ranks."""
    lowered = lower(simulate(dualpipev(W, B)))
    for w, full in enumerate(torch_full_backwards(W, B)):
        whole = whole_backwards(lowered, w)
        assert full <= whole, sorted(full - whole)
        splits = B * 2 - len(whole)
        assert splits <= B * 2 - len(full)


def test_refused_elsewhere():
    """order=dualpipev needs vshape, the split backward and microbatches >= stages."""
    with pytest.raises(StepError, match="order=dualpipev is invalid with strategy=lpp"):
        make_schedule("lpp", 4, 4, G=1, R=2, order="dualpipev", split_backward=True)
    with pytest.raises(ValueError, match="needs split_backward=True"):
        make_schedule("vshape", 4, 4, order="dualpipev")
    with pytest.raises(StepError) as e:
        make_schedule("vshape", 8, 7, order="dualpipev", split_backward=True)
    assert e.value.sentences == [
        "microbatches=7 is invalid with order=dualpipev: it needs at least as many micro-batches as stages=8 "
        "(as PyTorch's schedule does); set microbatches >= 8."]
    make_schedule("vshape", 8, 8, order="dualpipev", split_backward=True)  # B = S is enough
    with pytest.raises(ValueError, match="microbatches=3 is invalid with order=dualpipev"):
        simulate(unchecked_schedule("vshape", 4, 3, order="dualpipev", split_backward=True))  # the order checks too


def test_config_group():
    """``conf/order/dualpipev.yaml`` names the order (composed from this checkout's ``conf/``), and
    the command line's sentences are the Python API's."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    import launcher.config  # noqa: F401  (registers the schema and the resolver)
    from launcher.config import errors, to_schedule

    with initialize_config_dir(str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["strategy=vshape", "stages=8", "microbatches=8", "order=dualpipev",
                                           "split_backward=true"])
        assert errors(cfg) == []
        step = to_schedule(cfg)
        assert (cfg.G, cfg.R, step.workers, step.order.name) == (1, 4, 4, "dualpipev")
        unsplit = compose("config", overrides=["strategy=vshape", "stages=8", "microbatches=8", "order=dualpipev"])
        assert errors(unsplit) == [
            "split_backward=false is invalid with order=dualpipev: it runs the weight-gradient "
            "jobs W apart, which exist only when the backward is split; leave split_backward at true."]
        few = compose("config", overrides=["strategy=vshape", "stages=8", "microbatches=4", "order=dualpipev",
                                           "split_backward=true"])
        assert errors(few) == [
            "microbatches=4 is invalid with order=dualpipev: it needs at least as many micro-batches as stages=8 "
            "(as PyTorch's schedule does); set microbatches >= 8."]
