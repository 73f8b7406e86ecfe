"""order=file: schedules as data. Every built-in order's step, written in our text form or
torch's CSV and read back, simulates to the identical timeline; a CSV written by torch's own
``_dump_csv`` from its own schedules runs here; ours loads in torch's ``_load_csv``; a file whose
placement disagrees with the scheme is refused in one sentence."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from helpers.torch_csv import dump_torch_csv, torch_full_order, torch_order
from launcher.plan.space import ORDERS, order_fits
from launcher.schedule import make_schedule, simulate
from launcher.schedule.actions import format_programs
from launcher.schedule.order_file import FileOrder, programs_of, read_jobs, write_schedule

pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")

# (scheme, stages, micro-batches, G, R)
SHAPES = [("gpipe", 4, 6, 1, 4), ("lpp", 4, 4, 1, 2), ("lpp", 6, 6, 2, 3), ("fslpp", 4, 8, 2, 2), ("fsdp", 3, 3, 3, 1)]


LOOPED = ("lpp", "fslpp")


def same(a, b) -> None:
    assert a.compute == b.compute and a.sequences == b.sequences
    assert a.start == b.start and a.finish == b.finish


@pytest.mark.parametrize("suffix", ["txt", "csv"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_round_trip_every_order(tmp_path: Path, shape: tuple, suffix: str) -> None:
    scheme, S, B, G, R = shape
    tried = 0
    for order, warmup in ORDERS:
        for split in (False, True):
            if not order_fits(order, R, S, split) or (order == "interleaved_1f1b" and scheme not in LOOPED):
                continue
            tl = simulate(make_schedule(scheme, S, B, G, R, order=order, warmup=warmup, split_backward=split))
            path = write_schedule(tl.schedule.space, tl.sequences, tmp_path / f"{order}-{warmup}-{split}.{suffix}")
            back = simulate(make_schedule(scheme, S, B, G, R, order=FileOrder(path=str(path)), split_backward=split))
            same(tl, back)
            tried += 1
    assert tried >= 6


@pytest.mark.parametrize("kind,ranks,per,B", [("interleaved", 2, 2, 4), ("interleaved", 4, 2, 8),
                                              ("bfs", 2, 2, 4), ("bfs", 4, 1, 6)])
def test_torch_dump_csv_runs_here(tmp_path: Path, kind: str, ranks: int, per: int, B: int) -> None:
    path = tmp_path / "torch.csv"
    dump_torch_csv(path, kind, ranks, per, B)  # torch's own writer
    S = ranks * per
    step = make_schedule("lpp" if per > 1 else "gpipe", S, B, 1, ranks, order=FileOrder(path=str(path)))
    tl = simulate(step)
    want = [[f"{a.stage_index}{a.computation_type.value}{a.microbatch_index}" for a in row if a is not None]
            for row in torch_order(kind, ranks, per, B).values()]
    got = [[f"{s}{d}{b}" for s, b, d in map(step.space.job, seq)] for seq in tl.sequences]
    assert got == want  # each rank ran exactly torch's sequence
    if kind == "interleaved":  # and it is our own interleaved_1f1b, job for job
        ours = simulate(make_schedule("lpp", S, B, 1, ranks, order="interleaved_1f1b"))
        same(ours, tl)


def test_torch_load_csv_reads_ours(tmp_path: Path) -> None:
    tl = simulate(make_schedule("lpp", 4, 4, 1, 2, order="interleaved_1f1b", split_backward=True))
    path = write_schedule(tl.schedule.space, tl.sequences, tmp_path / "ours.csv")
    fake = types.SimpleNamespace(pipeline_order={}, _validate_and_set_stage_mapping=lambda order: None)
    pipelining.PipelineScheduleMulti._load_csv(fake, str(path))  # torch's own reader
    assert [[str(a) for a in row] for row in fake.pipeline_order.values()] == \
        [[f"{s}{d}{b}" for s, b, d in map(tl.schedule.space.job, seq)] for seq in tl.sequences]


def test_a_whole_step_in_our_form_keeps_its_jobs_order(tmp_path: Path) -> None:
    from launcher.schedule.lowering import lower_actions

    tl = simulate(make_schedule("gpipe", 3, 4, 1, 3, order="1f1b"))
    lowered = format_programs(lower_actions(tl, "step"))
    assert "SEND_ACT" in lowered
    (tmp_path / "lowered.txt").write_text(lowered)
    assert read_jobs(tmp_path / "lowered.txt") == [[(a.op, a.stage, a.microbatch) for a in p]
                                                    for p in programs_of(tl.schedule.space, tl.sequences)]
    back = simulate(make_schedule("gpipe", 3, 4, 1, 3, order=FileOrder(path=str(tmp_path / "lowered.txt"))))
    same(tl, back)


# a whole step of ours (FSLPP: weight copies, partial sums; ZB-H1 on the split backward)
WHOLE = ("fslpp", 4, 4, 2, 2)


def _whole(order):
    return simulate(make_schedule(*WHOLE, order=order, split_backward=True))


def moved_earlier(progs, op: str) -> tuple[list, int]:
    """``progs`` with the last ``op`` of the first worker that has one moved to the start of its
    line (posted when the step starts): the edited programs and that worker."""
    w = next(w for w, prog in enumerate(progs) if any(a.op == op for a in prog))
    prog = list(progs[w])
    prog.insert(0, prog.pop(max(n for n, a in enumerate(prog) if a.op == op)))
    return [list(p) if v != w else prog for v, p in enumerate(progs)], w


@pytest.mark.parametrize("op", ["RECV_ACT", "RECV_WEIGHTS", "SEND_WEIGHTS"])
def test_a_whole_step_runs_as_written(tmp_path: Path, op: str) -> None:
    """A receive or a weight hand-over moved earlier than the lowering puts it stands where the file
    puts it, whatever the lookahead; the file's jobs, without its other actions, get the lowering's."""
    from launcher.schedule.actions import parse_programs
    from launcher.schedule.lowering import lower, lower_actions

    ref = _whole("zb_h1")
    ours = lower_actions(ref, "job", 1)
    edited, w = moved_earlier(ours, op)
    path = tmp_path / "step.txt"
    path.write_text(format_programs(edited))
    tl = _whole(FileOrder(path=str(path)))
    same(ref, tl)
    for prefetch in (0, 1, 2):
        assert lower_actions(tl, "job", prefetch) == edited
        assert format_programs(lower_actions(tl, "job", prefetch)) == path.read_text()
    lowered = lower(tl, "job", 1)
    assert lowered.programs[w].ops[0][0] == op and lowered.programs[w].ops != lower(ref, "job", 1).programs[w].ops
    path.write_text(format_programs([[a for a in p if a.is_job] for p in parse_programs(path.read_text())]))
    assert lower_actions(_whole(FileOrder(path=str(path))), "job", 1) == ours  # jobs only: the lowering's places


def _refusal(tmp_path: Path, edit) -> str:
    from launcher.schedule.lowering import LoweringError, lower, lower_actions

    progs = [list(p) for p in lower_actions(_whole("zb_h1"), "job", 1)]
    edit(progs)
    path = tmp_path / "step.txt"
    path.write_text(format_programs(progs))
    with pytest.raises(LoweringError) as e:
        lower(_whole(FileOrder(path=str(path))), "job", 1)
    msg = str(e.value)
    assert msg.startswith(f"order.path={path}: worker ") and "\n" not in msg and ". " not in msg, msg
    return msg.split(": ", 1)[1]


def _move(w: int, n: int, to: int):
    def edit(progs):
        progs[w].insert(to, progs[w].pop(n))
    return edit


def test_a_whole_step_that_does_not_fit_is_refused_in_one_sentence(tmp_path: Path) -> None:
    # w0: ... F0.b2  SEND_ACT s0.b2 ->w1.s1  SEND_WEIGHTS s2.b3 ->w2  RECV_ACT s2.b2 <-w1.s1  F2.b0 ...  F2.b2 ...
    from launcher.schedule.lowering import lower_actions

    w0 = lower_actions(_whole("zb_h1"), "job", 1)[0]
    recv = w0.index(next(a for a in w0 if repr(a) == "RECV_ACT s2.b2 <-w1.s1"))
    after = w0.index(next(a for a in w0 if repr(a) == "F2.b2")) + 1
    assert _refusal(tmp_path, _move(0, recv, after)) == (
        f"worker 0 position {after} is RECV_ACT s2.b2 <-w1.s1, after F2.b2, the job that needs it: a receive is "
        f"posted no later than just before the job that needs it")
    send = w0.index(next(a for a in w0 if repr(a) == "SEND_ACT s0.b0 ->w1.s1"))
    assert _refusal(tmp_path, _move(0, send, send + 3)) == (
        f"worker 0 position {send + 3} is SEND_ACT s0.b0 ->w1.s1, which the lowering puts right after F0.b0: only a "
        f"receive or an owner's weight hand-over may stand elsewhere (earlier), every other action stands where the "
        f"lowering puts it, in its order")
    hand = w0.index(next(a for a in w0 if repr(a) == "SEND_WEIGHTS s0.b1 ->w2"))
    # cache "job" hands that copy over twice (for F0.b1 and I0.b1): equal actions stand for each other
    assert "is SEND_WEIGHTS s0.b1 ->w2, later than its owner's release point (before F0.b0): an owner hands a copy " \
        "over no later than that" in _refusal(tmp_path, _move(0, hand, len(w0) - 1))
    assert _refusal(tmp_path, lambda progs: progs[0].pop(recv)) == (
        "worker 0 has no RECV_ACT s2.b2 <-w1.s1, which the lowering gives it: a whole step lists every action of "
        "each worker (a file of jobs only gets them all from the lowering)")
    assert _refusal(tmp_path, lambda progs: progs[1].insert(0, progs[0][send])) == (
        "worker 1 position 0 is SEND_ACT s0.b0 ->w1.s1, an action the step does not have there: a whole step's "
        "actions are those the lowering gives these jobs under this placement")


def test_wrong_files_are_refused_in_one_sentence(tmp_path: Path) -> None:
    good = simulate(make_schedule("gpipe", 2, 2, 1, 2, order="1f1b"))
    path = write_schedule(good.schedule.space, good.sequences, tmp_path / "s.txt")
    text = path.read_text()

    def refused(content: str, *words: str, split: bool = False) -> None:
        path.write_text(content)
        with pytest.raises(ValueError) as e:
            simulate(make_schedule("gpipe", 2, 2, 1, 2, order=FileOrder(path=str(path)), split_backward=split))
        msg = str(e.value)
        assert f"order.path={path}" in msg and msg.count(". ") == 0, msg
        for w in words:
            assert w in msg, msg

    lines = text.splitlines()
    refused("\n".join([lines[1].replace("w1", "w0"), lines[0].replace("w0", "w1")]), "F1.b0", "worker 1",
            "worker 0")
    refused(lines[0] + "\nw1:", "lacks")
    refused(text.replace("F1.b1", "F1.b0"), "twice")
    refused(text, "B0.b0", split=True)
    refused("w0: nonsense", "not a schedule")
    with pytest.raises(ValueError, match="cannot be read"):
        simulate(make_schedule("gpipe", 2, 2, 1, 2, order=FileOrder(path=str(tmp_path / "absent.txt"))))


# torch's full CSV (its compute_comms dump): (kind, ranks, stages per rank, micro-batches) and our scheme
FULL = [("bfs", 2, 1, 3, "gpipe"), ("interleaved", 2, 2, 4, "lpp"), ("zbv", 2, 2, 4, "vshape")]


@pytest.mark.parametrize("kind,ranks,per,B,scheme", FULL, ids=lambda v: str(v))
def test_torch_full_csv_runs_its_message_places(tmp_path: Path, kind: str, ranks: int, per: int, B: int,
                                                scheme: str) -> None:
    """A full CSV's sends and receives stand where torch put them, among the same jobs; the messages
    are ours (their peers from the placement), the rest of the step is ours too."""
    from launcher.schedule.actions import JOBS
    from launcher.schedule.lowering import lower, lower_actions
    from launcher.schedule.order_file import TORCH_MESSAGES

    S, split = ranks * per, kind == "zbv"
    full = dump_torch_csv(tmp_path / "full.csv", kind, ranks, per, B, comms=True)
    only = dump_torch_csv(tmp_path / "only.csv", kind, ranks, per, B)
    tl = simulate(make_schedule(scheme, S, B, 1, ranks, order=FileOrder(path=str(full)), split_backward=split))
    ours = simulate(make_schedule(scheme, S, B, 1, ranks, order=FileOrder(path=str(only)), split_backward=split))
    same(tl, ours)  # the same order: the messages do not change the jobs
    rows = torch_full_order(kind, ranks, per, B)
    want = [[(TORCH_MESSAGES.get(a.computation_type.value, a.computation_type.value), a.stage_index,
              a.microbatch_index) for a in row if a.computation_type.value in JOBS | TORCH_MESSAGES.keys()]
            for row in rows.values()]
    moved = 0
    for prefetch in (0, 1):
        got, mine = lower_actions(tl, "step", prefetch), lower_actions(ours, "step", prefetch)
        assert [[(a.op, a.stage, a.microbatch) for a in p] for p in got] == want  # torch's places, exactly
        assert [sorted(p) for p in got] == [sorted(p) for p in mine]  # the same messages, peers included
        assert lower(tl, "step", prefetch).programs  # and the timeline check passes (no receive after its job)
        moved += got != mine
    assert moved >= 1  # torch posts some receive elsewhere than ours at one of the two lookaheads


def test_gpipe_torch_places_receives_as_ours_without_lookahead(tmp_path: Path) -> None:
    """GPipe (one stage per rank): torch posts each receive just before its job, as ours at prefetch=0."""
    from launcher.schedule.lowering import lower_actions

    full = dump_torch_csv(tmp_path / "full.csv", "bfs", 4, 1, 8, comms=True)
    only = dump_torch_csv(tmp_path / "only.csv", "bfs", 4, 1, 8)
    tl = simulate(make_schedule("gpipe", 4, 8, 1, 4, order=FileOrder(path=str(full))))
    mine = simulate(make_schedule("gpipe", 4, 8, 1, 4, order=FileOrder(path=str(only))))
    assert lower_actions(tl, "step", 0) == lower_actions(mine, "step", 0)
    assert lower_actions(tl, "step", 1) != lower_actions(mine, "step", 1)


def test_torch_full_csv_refusals_name_rank_position_and_action(tmp_path: Path) -> None:
    from launcher.schedule.lowering import LoweringError, lower

    path = dump_torch_csv(tmp_path / "full.csv", "bfs", 2, 1, 2, comms=True)
    rows = [line.split(",") for line in path.read_text().splitlines()]
    assert rows[1][:3] == ["1UNSHARD", "1RECV_F0", "1F0"]
    where = f"order.path={path}"

    def refused(edited: list[list[str]]) -> str:
        path.write_text("\n".join(map(",".join, edited)) + "\n")
        with pytest.raises(LoweringError) as e:
            lower(simulate(make_schedule("gpipe", 2, 2, 1, 2, order=FileOrder(path=str(path)))))
        return str(e.value)

    assert refused([rows[0], [c for c in rows[1] if c != "1RECV_F0"]]) == (
        f"{where}: rank 1 has no 1RECV_F0 (ours: RECV_ACT s1.b0 <-w0.s0), which worker 1 runs in this step")
    assert refused([rows[0], ["1UNSHARD", "1RECV_F0", "1SEND_F0", *rows[1][2:]]]) == (
        f"{where}: rank 1 position 2 is torch's 1SEND_F0, a message worker 1 does not have in this step (its "
        f"peer stage runs on the same worker)")
    # a receive after the job that needs it: the timeline check's refusal, the action marked
    late = [c for c in rows[1] if c != "1RECV_F0"]
    late.insert(late.index("1F0") + 1, "1RECV_F0")
    assert ">>RECV_ACT s1.b0 <-w0.s0<<" in refused([rows[0], late])


def owner0(s: int, b: int, d: str) -> tuple[int, int]:
    """Torch's looped map on 2 ranks for the compute, every stage's weights on worker 0: worker 1
    runs stages 1 and 3 on copies it fetches and sends their gradient sums back (w_weights, w_compute)."""
    return 0, s % 2


@pytest.mark.parametrize("cache", ["step", "job"])
def test_torch_unshard_and_reduce_grad_map_onto_ours(tmp_path: Path, cache: str) -> None:
    """torch's UNSHARD of a stage is the weight copy of that stage's next job where that job runs on
    a fetched copy (worker 1: at torch's place, the start of the step), a no-op where the worker owns
    the stage (worker 0); its REDUCE_GRAD stands where our partial sum's send does; its RESHARD is
    a no-op. A REDUCE_GRAD moved before the last backward that adds to the sum is refused."""
    from launcher.schedule.actions import RECV_WEIGHTS
    from launcher.schedule.lowering import LoweringError, lower, lower_actions

    full = dump_torch_csv(tmp_path / "full.csv", "interleaved", 2, 2, 4, comms=True)
    only = dump_torch_csv(tmp_path / "only.csv", "interleaved", 2, 2, 4)
    rows = [line.split(",") for line in full.read_text().splitlines()]
    assert rows[1][:2] == ["1UNSHARD", "3UNSHARD"] and "3REDUCE_GRAD" in rows[1] and "1RESHARD" in rows[1]
    tl = simulate(make_schedule(owner0, 4, 4, G=1, R=2, order=FileOrder(path=str(full))))
    ours = lower_actions(simulate(make_schedule(owner0, 4, 4, G=1, R=2, order=FileOrder(path=str(only)))), cache, 0)
    got = lower_actions(tl, cache, 0)
    assert [sorted(p) for p in got] == [sorted(p) for p in ours]  # the same actions, some elsewhere
    # torch's two UNSHARDs on rank 1 are the copies of its first job of stage 1 and of stage 3
    assert [repr(a) for a in got[1][:2]] == ["RECV_WEIGHTS s1.b0 <-w0", "RECV_WEIGHTS s3.b0 <-w0"]
    assert [a.op for a in ours[1][:2]] != [RECV_WEIGHTS, RECV_WEIGHTS]  # ours (no lookahead) fetches just in time
    def rest(prog):  # all but the activation and gradient messages (placed as torch's SEND/RECV)
        return [a for a in prog if a.op not in ("SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD")]

    assert rest(got[0]) == rest(ours[0])  # the owner of every stage: its UNSHARDs, REDUCE_GRADs, RESHARDs are no-ops
    # the REDUCE_GRAD of stage 3 stands right after 3B3, as our SEND_WGRAD s3 ->w0 does
    last = got[1].index(next(a for a in got[1] if repr(a) == "B3.b3"))
    assert "SEND_WGRAD s3 ->w0" in map(repr, got[1][last + 1 : last + 4])  # after its SEND_GRAD (and FREE_WEIGHTS)
    assert lower(tl, cache, 1).programs  # the timeline check passes
    early = [c for c in rows[1] if c != "3REDUCE_GRAD"]
    early.insert(early.index("3B2") + 1, "3REDUCE_GRAD")
    full.write_text("\n".join(map(",".join, [rows[0], early])) + "\n")
    with pytest.raises(LoweringError) as e:
        lower(simulate(make_schedule(owner0, 4, 4, G=1, R=2, order=FileOrder(path=str(full)))), cache, 1)
    assert str(e.value) == (
        f"order.path={full}: rank 1 position {early.index('3REDUCE_GRAD')} is torch's 3REDUCE_GRAD, where worker "
        f"1's SEND_WGRAD s3 ->w0 stands right after B3.b3: a stage's gradient sum is sent or reduced right after "
        f"the last job that adds to it")
