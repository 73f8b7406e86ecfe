"""order=file on real worker processes (gloo, float64): a schedule written by torch's own
``_dump_csv`` (its looped breadth-first, backwards newest first, and its interleaved 1F1B, also
as the full CSV with torch's sends and receives, also under a placement whose weight copies and
partial sums torch's UNSHARD and REDUCE_GRAD stand for), and one of ours exported and read back (ZB-H1
on the split backward), each train exactly as one process does, and the runtime's counts equal
the simulator's; torch's full CSV, its receives posted where torch put them, trains bit-equal to
the same order from our text."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from test_runtime_oracle import _check  # its rootdir is on sys.path, as for every test module

from launcher.runtime import Engine, launch
from launcher.runtime.oracle import Case, mlp_batches, run_cases, staged_mlp
from launcher.schedule import make_schedule, simulate
from launcher.schedule.lowering import lower
from launcher.schedule.order_file import FileOrder, write_schedule

pytest.importorskip("torch.distributed.pipelining.schedules")
from helpers.torch_csv import dump_torch_csv  # noqa: E402 - it needs torch's pipelining

_DIR = Path(tempfile.mkdtemp(prefix="order_file_oracle_"))  # written before the workers fork


def _torch_csv(name: str, kind: str, ranks: int, per: int, B: int, comms: bool = False) -> FileOrder:
    return FileOrder(path=str(dump_torch_csv(_DIR / name, kind, ranks, per, B, comms)))


def _ours(name: str, *args, **kw) -> FileOrder:
    tl = simulate(make_schedule(*args, **kw))
    return FileOrder(path=str(write_schedule(tl.schedule.space, tl.sequences, _DIR / name)))


def owner0(s: int, b: int, d: str) -> tuple[int, int]:
    """(w_weights, w_compute): torch's looped map on 2 ranks computes, worker 0 owns every stage, so
    worker 1 fetches stages 1 and 3 (torch's UNSHARD of them) and sends their sums back (REDUCE_GRAD)."""
    return 0, s % 2


CASES = [
    Case("lpp", 1, 2, 4, 4, order=_torch_csv("bfs.csv", "bfs", 2, 2, 4), optimizer="adam"),
    Case("lpp", 1, 4, 8, 8, order=_torch_csv("interleaved.csv", "interleaved", 4, 2, 8)),
    Case("lpp", 1, 2, 4, 4, order=_torch_csv("full.csv", "interleaved", 2, 2, 4, comms=True)),
    Case("owner0", 1, 2, 4, 4, order=_torch_csv("full_owner0.csv", "interleaved", 2, 2, 4, comms=True),
         weight_cache="job", placement=owner0, W=2),
    Case("gpipe", 1, 4, 4, 8, order=_ours("zb_h1.txt", "gpipe", 4, 8, 1, 4, order="zb_h1", split_backward=True),
         split=True),
    Case("fslpp", 2, 2, 8, 4, order=_ours("fslpp.txt", "fslpp", 8, 4, 2, 2, order="breadth_first"),
         weight_cache="job"),
]


# torch's full CSV and our text of the same order (torch's interleaved 1F1B, 2 ranks, 4 stages, 4 micro-batches)
PAIR = (CASES[2].order, _ours("pair.txt", "lpp", 4, 4, 1, 2, order=_torch_csv("pair.csv", "interleaved", 2, 2, 4)))


def _train(order: FileOrder) -> dict[int, list[torch.Tensor]]:
    engine = Engine(staged_mlp(4), make_schedule("lpp", 4, 4, G=1, R=2, order=order),
                    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    for step in range(2):
        engine.train_step(mlp_batches(4, seed=step))
    return {s: [p.detach().clone() for p in engine.modules[s].parameters()] for s in engine.owned}


def _all() -> tuple[list, list]:
    return run_cases(CASES), [_train(order) for order in PAIR]


@pytest.fixture(scope="module")
def ranks():
    return launch(_all, 4, timeout=20, deadline=240)


@pytest.fixture(scope="module")
def results(ranks):
    return [(c, [r[0][i] for r in ranks]) for i, c in enumerate(CASES)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("i", range(len(CASES)), ids=lambda i: CASES[i].name + "-" + Path(CASES[i].order.path).name)
def test_file_order_trains_as_one_process(results, i):
    _check(*results[i])


@pytest.mark.timeout(300)
def test_torch_full_csv_trains_bit_equal_to_our_text_of_its_order(ranks):
    programs = [lower(simulate(make_schedule("lpp", 4, 4, G=1, R=2, order=o))).programs for o in PAIR]
    assert programs[0] != programs[1]  # torch's receives stand elsewhere: two different programs ran
    owned = {}
    for rank in ranks[:2]:
        torch_placed, ours = rank[1]
        assert torch_placed.keys() == ours.keys()
        for s in ours:
            assert all(torch.equal(a, b) for a, b in zip(torch_placed[s], ours[s])), s
        owned.update(ours)
    assert sorted(owned) == [0, 1, 2, 3]
    start = staged_mlp(4)  # and training moved every stage
    assert all(not torch.equal(owned[s][0], next(start.stages[s].parameters())) for s in owned)
