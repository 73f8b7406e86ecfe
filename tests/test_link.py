"""The gradient exchange a measured link adds after the simulated compute (launcher.schedule.link)."""

from __future__ import annotations

import pytest

from launcher.schedule import make_step, simulate
from launcher.schedule.link import Link, end_of_step, step_time

LINK = Link(latency_s=0.5, bytes_per_s=10.0)
GRADS = [40.0, 20.0]  # bytes of each stage's gradient


def test_ddp_replicas_all_reduce_ring_style():
    tl = simulate(make_step("ddp", 2, 4, G=4, R=1))
    # each stage: 4 owners, 2 (n-1) = 6 rounds, 2 (n-1)/n of the gradient each way
    per_worker = 2 * 6 * 0.5 + 1.5 * (40 + 20) / 10.0
    assert end_of_step(tl, GRADS, LINK) == pytest.approx([per_worker] * 4)
    assert step_time(tl, GRADS, LINK) == pytest.approx(tl.latency + per_worker)


def test_gpipe_owners_compute_their_stage_and_exchange_nothing():
    tl = simulate(make_step("gpipe", 2, 4, G=1, R=2))
    assert end_of_step(tl, GRADS, LINK) == [0.0, 0.0]
    assert step_time(tl, GRADS, LINK) == tl.latency


def test_fsdp_sends_each_partial_to_its_owner():
    tl = simulate(make_step("fsdp", 2, 2, G=2, R=1))
    owner = [tl.weights[s * 2] for s in range(2)]  # one owner per stage
    assert sorted(owner) == [0, 1]
    # each worker sends its partial of the stage it does not own and receives the other's of its own
    tails = end_of_step(tl, GRADS, LINK)
    for w in range(2):
        mine = GRADS[owner.index(w)]
        other = GRADS[1 - owner.index(w)]
        assert tails[w] == pytest.approx(0.5 + max(mine, other) / 10.0)
    # a worker's exchange starts after its own last job
    finish = [max(tl.finish[j] for j in prog) for prog in tl.program]
    assert step_time(tl, GRADS, LINK) == pytest.approx(max(f + t for f, t in zip(finish, tails)))
