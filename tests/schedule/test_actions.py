"""Per-worker action lists: their text round-trips, they describe the plan exactly, and a step the
runtime cannot lower names the offending action in a grid of every worker's program."""

from __future__ import annotations

import re

import pytest

from launcher.schedule import make_schedule, simulate
from launcher.schedule.actions import (
    BEFORE,
    COMPUTE,
    FREE_WEIGHTS,
    FREE_WGRAD,
    RECV_ACT,
    RECV_GRAD,
    RECV_WEIGHTS,
    RECV_WGRAD,
    REDUCE,
    SEND_ACT,
    SEND_GRAD,
    SEND_WEIGHTS,
    SEND_WGRAD,
    Action,
    format_programs,
    parse_programs,
)
from launcher.schedule.assembly import assemble
from launcher.schedule.lowering import LoweringError, lower, lower_actions
from launcher.schedule.program import ACT, GRAD, WEIGHTS, WGRAD, Lowered

# (scheme, S, B, G, R, order, split backward): every scheme, both backward forms, W <= 4
CONFIGS = [
    ("ddp", 3, 4, 4, 1, "1f1b", False),
    ("fsdp", 4, 4, 4, 1, "1f1b", True),
    ("gpipe", 4, 6, 1, 4, "1f1b", False),
    ("lpp", 4, 4, 2, 2, "breadth_first", False),
    ("fslpp", 4, 4, 2, 2, "depth_first", True),
    ("fslpp", 4, 4, 2, 2, "1f1b", False),
    ("gpipe", 4, 8, 1, 4, "zb_h1", True),
    ("lpp", 4, 4, 2, 2, "zb_h1", True),
    ("gpipe", 4, 8, 1, 4, "zb_h2", True),
    ("lpp", 4, 4, 2, 2, "zb_h2", True),
]
KINDS = set(COMPUTE) | {SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD, SEND_WEIGHTS, RECV_WEIGHTS, FREE_WEIGHTS, SEND_WGRAD,
                        RECV_WGRAD, FREE_WGRAD, REDUCE}
SENDS = {ACT: SEND_ACT, GRAD: SEND_GRAD, WEIGHTS: SEND_WEIGHTS, WGRAD: SEND_WGRAD}


def _timeline(name, S, B, G, R, order, split):
    return simulate(make_schedule(name, S, B, G=G, R=R, order=order, split_backward=split))


def _same(a: Lowered, b: Lowered) -> None:
    assert a.messages == b.messages
    assert a.programs == b.programs
    assert (a.owners, a.predicted, a.reduce_order, a.prefetch) == (b.owners, b.predicted, b.reduce_order, b.prefetch)


@pytest.mark.parametrize("cache", ["step", "job"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}-{c[5]}-{'split' if c[6] else 'joint'}")
def test_programs_print_parse_back_and_give_the_same_plan(config, cache):
    tl = _timeline(*config)
    progs = lower_actions(tl, cache, 2)
    for prog in progs:
        for a in prog:
            assert Action.from_str(repr(a)) == a and str(a) == repr(a)
    text = format_programs(progs)
    assert parse_programs(text) == progs
    assert parse_programs(format_programs(progs, align=True)) == progs
    plan = lower(tl, cache, 2)
    _same(assemble(tl, parse_programs(text), cache, 2), plan)
    # the jobs are the timeline's, and one send action per message of each kind
    assert [[j.job for j in p.jobs] for p in plan.programs] == tl.sequences
    for kind, op in SENDS.items():
        assert sum(a.op == op for prog in progs for a in prog) == sum(m.kind == kind for m in plan.messages)


def test_every_kind_is_met_and_round_trips():
    seen: set[str] = set()
    for config in CONFIGS:
        for cache in ("step", "job"):
            seen |= {a.op for prog in lower_actions(_timeline(*config), cache) for a in prog}
    assert seen == KINDS


@pytest.mark.parametrize("text", ["F3.b1", "W0.b12", "SEND_ACT s3.b1 ->w2.s4", "RECV_GRAD s0.b7 <-w3.s1",
                                  "SEND_WEIGHTS s2.b0 ->w0", "RECV_WEIGHTS s3.b1 <-w1", "FREE_WEIGHTS s3",
                                  "SEND_WGRAD s1 ->w0", "RECV_WGRAD s1 <-w2", "FREE_WGRAD s1 ->w0", "REDUCE s5"])
def test_each_form_reads_back(text):
    assert repr(Action.from_str(text)) == text


@pytest.mark.parametrize("text", ["F3", "X3.b1", "SEND_ACT s3 ->w2", "SEND_ACT s3.b1 <-w2.s4", "REDUCE s3 ->w1",
                                  "RECV_WEIGHTS s3 <-w0", "FREE_WEIGHTS", "send_act s3.b1 ->w2.s4"])
def test_malformed_actions_are_refused(text):
    with pytest.raises(ValueError, match="is not an action"):
        Action.from_str(text)


def test_a_placement_that_splits_a_microbatch_is_shown_marked():
    def apart(s, b, d):
        return (0, 0 if d == "F" else 1)

    step = make_schedule(apart, 2, 2)
    step.workers = 2
    with pytest.raises(LoweringError) as e:
        lower(simulate(step))
    lines = str(e.value).splitlines()
    assert re.search(r"runs F\(0,0\) on worker 0 but B\(0,0\) on worker 1", lines[0])
    assert lines[1].split() == ["w0:", "F0.b0", "F1.b0", "F0.b1", "F1.b1"]
    assert lines[2].split() == ["w1:", "B1.b0", ">>B0.b0<<", "B1.b1", "B0.b1"]
    assert lines[1].index("F0.b1") == lines[2].index("B1.b1")  # a grid: columns aligned
    assert "holds its activations" in lines[3]


def test_a_large_grid_shows_the_columns_around_the_mark():
    progs = [[Action("F", 0, b) for b in range(40)], [Action("B", 0, b) for b in range(40)]]
    text = format_programs(progs, mark=(1, 20), around=2)
    assert text.splitlines() == ["w0: ...  F0.b18  F0.b19  F0.b20  F0.b21  F0.b22  ...",
                                 "w1: ...  B0.b18  B0.b19  >>B0.b20<<  B0.b21  B0.b22  ..."]


def _break(tl, cache, change):
    """Lower ``tl``, edit worker programs with ``change`` and rebuild: the error's marked action."""
    progs = lower_actions(tl, cache)
    change(progs)
    with pytest.raises(LoweringError) as e:
        assemble(tl, progs, cache)
    marked = re.findall(r">>(.*?)<<", str(e.value))
    return str(e.value), marked


def test_an_edited_program_that_does_not_fit_is_refused_with_the_action_marked():
    tl = _timeline("gpipe", 4, 4, 1, 4, "1f1b", False)

    def drop_a_receive(progs):
        n = next(n for n, a in enumerate(progs[1]) if a.op == RECV_ACT)
        del progs[1][n]

    text, marked = _break(tl, "step", drop_a_receive)
    assert "has no matching receive on worker 1" in text and marked == ["SEND_ACT s0.b0 ->w1.s1"]

    def swap_two_jobs(progs):
        jobs = [n for n, a in enumerate(progs[0]) if a.op in COMPUTE]
        progs[0][jobs[0]], progs[0][jobs[1]] = progs[0][jobs[1]], progs[0][jobs[0]]

    text, marked = _break(tl, "step", swap_two_jobs)
    assert "worker 0 does not run the timeline's jobs" in text and marked == ["F0.b1"]

    def receive_after_the_last_job(progs):
        progs[1].append(Action(RECV_ACT, 1, 0, 0, 0))

    text, marked = _break(tl, "step", receive_after_the_last_job)
    assert "does not sit beside a job" in text and marked == ["RECV_ACT s1.b0 <-w0.s0"]

    def send_to_itself(progs):
        n = next(n for n, a in enumerate(progs[0]) if a.op == SEND_ACT)
        progs[0][n] = progs[0][n]._replace(peer=0)

    text, marked = _break(tl, "step", send_to_itself)
    assert "names worker 0" in text and marked == ["SEND_ACT s0.b0 ->w0.s1"]


def test_kinds_before_a_job_belong_to_it_and_the_rest_to_the_job_before():
    """The print order: between two jobs, the earlier one's sends and frees, then what the later
    one needs handed over or received first."""
    tl = _timeline("fslpp", 4, 4, 2, 2, "1f1b", True)
    for prog in lower_actions(tl, "job"):
        after = True  # since the last job, only its own kinds so far
        for a in prog:
            if a.is_job:
                after = True
            elif a.op in BEFORE:
                after = False
            else:
                assert after or a.op == REDUCE, prog
