"""The printed schedule is the program that runs: the action lists of a step (FSLPP, ZB-H1 order,
split backward), printed as text, parsed back and run on real workers (gloo, float64), train
bit-equal to the same step lowered in memory; so does the same text edited, a receive and a weight
copy posted earlier than the lowering puts them, given as ``order=file``, and the program the
workers run has them where the file put them."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from launcher.runtime import Engine, launch
from launcher.runtime.oracle import mlp_batches, staged_mlp
from launcher.schedule import make_schedule, simulate
from launcher.schedule.actions import RECV_ACT, RECV_WEIGHTS, SEND_WEIGHTS, format_programs, parse_programs
from launcher.schedule.assembly import assemble
from launcher.schedule.lowering import lower, lower_actions
from launcher.schedule.order_file import FileOrder

S, B, G, R, PREFETCH, STEPS = 4, 4, 2, 2, 1, 2
CACHES = ("job", "step")


def _timeline(order: object = "zb_h1"):
    return simulate(make_schedule("fslpp", S, B, G=G, R=R, order=order, split_backward=True))


# printed here, before the workers fork: what they run is this text
TEXTS = {cache: format_programs(lower_actions(_timeline(), cache, PREFETCH), align=True) for cache in CACHES}


def _posted_first(progs: list, w: int, ops: tuple[str, ...]) -> list:
    """``progs`` with worker ``w``'s last action of each kind in ``ops`` moved to the start of its
    line: posted when the step starts, earlier than the lowering (``prefetch`` jobs ahead) puts it."""
    prog = list(progs[w])
    for op in ops:
        prog.insert(0, prog.pop(max(n for n, a in enumerate(prog) if a.op == op)))
    return [prog if v == w else list(p) for v, p in enumerate(progs)]


# the job-cache step edited by hand: worker 1 posts a receive of an activation and of a weight copy at once
MOVED_WORKER = 1
MOVED = _posted_first(lower_actions(_timeline(), "job", PREFETCH), MOVED_WORKER, (RECV_ACT, RECV_WEIGHTS))
MOVED_FILE = Path(tempfile.mkdtemp(prefix="printed_program_")) / "moved.txt"
MOVED_FILE.write_text(format_programs(MOVED) + "\n")


def _train(cache: str, text: str | None) -> dict[int, list[torch.Tensor]]:
    tl = _timeline()
    lowered = lower(tl, cache, PREFETCH) if text is None else assemble(tl, parse_programs(text), cache, PREFETCH)
    return _train_lowered(cache, lowered)


def _train_lowered(cache: str, lowered) -> dict[int, list[torch.Tensor]]:
    engine = Engine(staged_mlp(S), lowered, lambda ps: torch.optim.SGD(ps, lr=0.1), prefetch=PREFETCH,
                    weight_cache=cache)
    for step in range(STEPS):
        engine.train_step(mlp_batches(B, seed=step))
    return {s: [p.detach().clone() for p in engine.modules[s].parameters()] for s in engine.owned}


def _both() -> tuple[list[tuple[dict, dict]], dict]:
    edited = _train_lowered("job", lower(_timeline(FileOrder(path=str(MOVED_FILE))), "job", PREFETCH))
    return [(_train(cache, None), _train(cache, TEXTS[cache])) for cache in CACHES], edited


def test_the_printed_text_has_every_action_it_runs():
    """Prefetch is resolved in the text: a receive stands ahead of the job it feeds."""
    for cache, text in TEXTS.items():
        progs = parse_programs(text)
        ops = {a.op for prog in progs for a in prog}
        assert {RECV_ACT, RECV_WEIGHTS, SEND_WEIGHTS} <= ops, cache
        # at least one receive is posted a job earlier than the job it feeds
        assert any(a.op == RECV_ACT and b.is_job and (b.stage, b.microbatch) != (a.stage, a.microbatch)
                   for prog in progs for a, b in zip(prog, prog[1:])), cache


@pytest.mark.timeout(300)
def test_a_parsed_program_trains_bit_equal_to_the_lowered_one():
    per_rank = launch(_both, G * R, timeout=20, deadline=240)
    start = staged_mlp(S)
    for k in range(len(CACHES)):
        owned = {}
        for runs, edited in per_rank:  # FSLPP's owners h(s, s): workers 0 and 3 hold every stage
            memory, parsed = runs[k]
            assert memory.keys() == parsed.keys()
            for s in memory:
                assert all(torch.equal(a, b) for a, b in zip(memory[s], parsed[s])), s
                if CACHES[k] == "job":  # the file with receives moved earlier trains bit-equal too
                    assert all(torch.equal(a, b) for a, b in zip(memory[s], edited[s])), s
            owned.update(memory)
        assert sorted(owned) == list(range(S))
        # and training changed every stage: the comparison is not between two untouched models
        assert all(not torch.equal(owned[s][0], next(start.stages[s].parameters())) for s in range(S))


def test_mode_simulate_writes_and_prints_the_program_the_workers_run(tmp_path, capsys):
    from rich.console import Console

    from launcher.modes.simulation import print_program

    tl = _timeline()
    print_program(tl, "job", PREFETCH, tmp_path, Console())
    text = (tmp_path / "actions.txt").read_text()
    assert text.strip() in capsys.readouterr().out
    assert assemble(tl, parse_programs(text), "job", PREFETCH).programs == lower(tl, "job", PREFETCH).programs


def test_a_file_with_receives_moved_earlier_is_the_program_that_runs():
    """What the engine runs (``Engine.lowered``, from ``lower``) and what ``mode=simulate`` prints
    are the file, the moved receives first, where the lowering has them a job ahead."""
    tl = _timeline(FileOrder(path=str(MOVED_FILE)))
    assert lower_actions(tl, "job", PREFETCH) == MOVED
    ops = lower(tl, "job", PREFETCH).programs[MOVED_WORKER].ops
    assert [op for op, _ in ops[:2]] == [RECV_WEIGHTS, RECV_ACT]
    assert lower(_timeline(), "job", PREFETCH).programs[MOVED_WORKER].ops[:2] != ops[:2]
