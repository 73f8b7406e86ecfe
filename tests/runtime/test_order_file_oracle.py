"""order=file on real worker processes (gloo, float64): a schedule written by torch's own
``_dump_csv`` (its looped breadth-first, backwards newest first, and its interleaved 1F1B), and
one of ours exported and read back (ZB-H1 on the split backward), each train exactly as one
process does, and the runtime's counts equal the simulator's."""

from __future__ import annotations

import tempfile
import types
from pathlib import Path

import pytest
from test_runtime_oracle import _check  # its rootdir is on sys.path, as for every test module

from launcher.runtime import launch
from launcher.runtime.oracle import Case, run_cases
from launcher.schedule import make_schedule, simulate
from launcher.schedule.order_file import FileOrder, write_schedule

pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")

_DIR = Path(tempfile.mkdtemp(prefix="order_file_oracle_"))  # written before the workers fork


def _torch_csv(name: str, kind: str, ranks: int, per: int, B: int) -> FileOrder:
    order = {}
    for r in range(ranks):
        if kind == "interleaved":
            rounds = max(1, B // ranks)
            sched = types.SimpleNamespace(n_local_stages=per, microbatches_per_round=B // rounds, pp_group_size=ranks,
                                          _n_microbatches=B)
            order[r] = pipelining.ScheduleInterleaved1F1B._calculate_single_rank_operations(sched, r)
        else:
            sched = types.SimpleNamespace(_stages=[None] * per, pp_group_size=ranks, _n_microbatches=B)
            order[r] = pipelining.ScheduleLoopedBFS._calculate_single_rank_operations(sched, r)
    path = _DIR / name
    pipelining.PipelineScheduleMulti._dump_csv(types.SimpleNamespace(pipeline_order=order), str(path))
    return FileOrder(path=str(path))


def _ours(name: str, *args, **kw) -> FileOrder:
    tl = simulate(make_schedule(*args, **kw))
    return FileOrder(path=str(write_schedule(tl.schedule.space, tl.sequences, _DIR / name)))


CASES = [
    Case("lpp", 1, 2, 4, 4, order=_torch_csv("bfs.csv", "bfs", 2, 2, 4), optimizer="adam"),
    Case("lpp", 1, 4, 8, 8, order=_torch_csv("interleaved.csv", "interleaved", 4, 2, 8)),
    Case("gpipe", 1, 4, 4, 8, order=_ours("zb_h1.txt", "gpipe", 4, 8, 1, 4, order="zb_h1", split_backward=True),
         split=True),
    Case("fslpp", 2, 2, 8, 4, order=_ours("fslpp.txt", "fslpp", 8, 4, 2, 2, order="breadth_first"),
         weight_cache="job"),
]


@pytest.fixture(scope="module")
def results():
    per_rank = launch(run_cases, 4, CASES, timeout=20, deadline=240)
    return [(c, [r[i] for r in per_rank]) for i, c in enumerate(CASES)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("i", range(len(CASES)), ids=lambda i: CASES[i].name + "-" + Path(CASES[i].order.path).name)
def test_file_order_trains_as_one_process(results, i):
    _check(*results[i])
