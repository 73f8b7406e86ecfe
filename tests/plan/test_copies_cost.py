"""``fault.copies=1`` in the simulator and the planner (pure Python): which stages each worker sends
after a step and keeps (:mod:`launcher.schedule.copies`), their bytes in the memory model, their
traffic and link time in a candidate, and the per-worker columns of ``mode=simulate``."""

from __future__ import annotations

import pytest

import launcher.config  # noqa: F401  (registers the schema)
from launcher.modes.simulation import simulate_config
from launcher.plan import Budget, memory, search
from launcher.plan.from_config import budget_of
from launcher.plan.profile import from_dict
from launcher.schedule.copies import ring_copies

#: as tests/plan/test_planner.py's LINKED: per stage 10/20/20/10 bytes of parameters and twice that of
#: optimizer state; a link of 0.05 s per message and 20 bytes/s
PROFILE = {"durations_s": {"F": 1.0, "B": 2.2}, "comm_s": 0.1,
           "bytes": {"params": [10, 20, 20, 10], "grads": [10, 20, 20, 10], "optimizer": [20, 40, 40, 20],
                     "activation": [5, 8, 8, 3]},
           "link": {"latency_s": 0.05, "bytes_per_s": 20.0}}


def test_lone_stages_go_round_the_ring_and_replicated_ones_stay() -> None:
    # fsdp W=4: stage s on worker s; fslpp G=2 R=2: stages 0, 2 on worker 0 and 1, 3 on worker 3
    assert ring_copies([{0}, {1}, {2}, {3}]) == ([{0}, {1}, {2}, {3}], [{3}, {0}, {1}, {2}])
    fslpp = [{0, 2}, set(), set(), {1, 3}]
    assert ring_copies(fslpp) == (fslpp, [{1, 3}, {0, 2}, set(), set()])
    # lpp G=2 R=2: every stage on two workers, a replica already; one worker: no one to copy to
    assert ring_copies([{0, 2}, {1, 3}, {0, 2}, {1, 3}]) == ([set()] * 4, [set()] * 4)
    assert ring_copies([{0, 1, 2, 3}]) == ([set()], [set()])
    # parameters and optimizer state per stage: 30, 60, 60, 30 bytes
    prof = from_dict(PROFILE)
    assert memory.copies_of([{0}, {1}, {2}, {3}], prof) == ([30, 60, 60, 30], [30, 30, 60, 60])


def test_the_planner_counts_the_copies_memory_traffic_and_link_time() -> None:
    prof = from_dict(PROFILE)
    plain = {c.point: c for c in search(4, [4], 4, prof, Budget(), top=10_000).candidates}
    copied = {c.point: c for c in search(4, [4], 4, prof, Budget(copies=1), top=10_000).candidates}
    # fsdp's layout (the planner lists it as fslpp G=4 R=1, the same schedule): stage s owned by worker s
    fsdp = [p for p in copied if p.scheme.name == "fslpp" and (p.G, p.R) == (4, 1) and p.weight_cache == "step"]
    lpp = [p for p in copied if p.scheme.name == "lpp" and p.G == 2 and p.R == 2 and p.weight_cache == "step"]
    assert fsdp and lpp
    for p in fsdp:
        a, b = plain[p], copied[p]
        assert [y - x for x, y in zip(a.peak_bytes, b.peak_bytes)] == [30, 30, 60, 60]  # the copy kept
        assert b.traffic_bytes - a.traffic_bytes == 180  # every stage's state sent once per step
        assert b.traffic_messages - a.traffic_messages == 4
        assert b.step_time - a.step_time == pytest.approx(0.05 + 60 / 20)  # the largest message on the link
    for p in lpp:  # replicated stages: no copy, no cost
        a, b = plain[p], copied[p]
        assert (a.peak_bytes, a.traffic_bytes, a.step_time) == (b.peak_bytes, b.traffic_bytes, b.step_time)
    # a byte budget that fsdp fits without the copy but not with it
    tight = max(plain[fsdp[0]].peak_bytes)
    fits = {c.point for c in search(4, [4], 4, prof, Budget(bytes=tight, copies=1), top=10_000).candidates}
    assert fsdp[0] not in fits and fsdp[0] in {c.point for c in search(4, [4], 4, prof, Budget(bytes=tight),
                                                                        top=10_000).candidates}


@pytest.mark.parametrize(("overrides", "sent", "kept"), [
    (["strategy=fsdp", "G=4"], [1, 1, 1, 1], [1, 1, 1, 1]),
    (["strategy=fslpp", "G=2", "R=2"], [2, 0, 0, 2], [2, 2, 0, 0]),
    (["strategy=lpp", "G=2", "R=2"], [0, 0, 0, 0], [0, 0, 0, 0]),
])
def test_simulate_reports_the_stages_sent_and_kept(cfg_of, overrides: list[str], sent: list[int],
                                                   kept: list[int]) -> None:
    cfg = cfg_of(["mode=simulate", "stages=4", "microbatches=4", "fault.restarts=1", "fault.copies=1", *overrides])
    summary = simulate_config(cfg)[1]
    assert (summary["per_worker"]["copies_sent"], summary["per_worker"]["copies_kept"]) == (sent, kept)
    assert summary["total"]["copies_kept"] == sum(kept)
    assert "copies_kept" not in simulate_config(cfg_of(["mode=simulate", "stages=4", "microbatches=4",
                                                        *overrides]))[1]["per_worker"]
    assert budget_of(cfg).copies == 1
