"""The gradient exchange a measured link adds after the simulated compute (launcher.schedule.link)."""

from __future__ import annotations

import pytest

from launcher.schedule import make_schedule, simulate
from launcher.schedule.link import ROOT_BYTES, Link, end_of_step, exchanges, step_time

LINK = Link(latency_s=0.5, bytes_per_s=10.0)
GRADS = [40.0, 20.0]  # bytes of each stage's gradient


def test_small_replicated_gradients_go_through_one_root():
    tl = simulate(make_schedule("ddp", 2, 4, G=4, R=1))
    # 4 owners of 60 bytes: the root receives and sends 3 x 60 in 2 rounds, the others 60
    root, other = 2 * 0.5 + 3 * 60 / 10.0, 2 * 0.5 + 60 / 10.0
    assert end_of_step(tl, GRADS, LINK) == pytest.approx([root, other, other, other])
    assert step_time(tl, GRADS, LINK) == pytest.approx(tl.latency + root)


@pytest.mark.parametrize("G,rounds", [(4, 6), (3, 4), (8, 14), (6, 10)])
def test_large_replicated_gradients_go_round_the_ring(G, rounds):
    big = [float(ROOT_BYTES), float(ROOT_BYTES)]
    tl = simulate(make_schedule("ddp", 2, G, G=G, R=1))
    # the backend's ring: 2 (n-1) rounds, 2 (n-1)/n of the bytes
    each = rounds * 0.5 + 2 * (G - 1) / G * sum(big) / 10.0
    assert end_of_step(tl, big, LINK) == pytest.approx([each] * G)


@pytest.mark.parametrize("G", [2, 4, 8])
@pytest.mark.parametrize("big", [False, True])
def test_replicated_gradients_through_shared_memory_take_two_rounds_and_no_link_bytes(G, big):
    grads = [float(ROOT_BYTES)] * 2 if big else GRADS
    tl = simulate(make_schedule("ddp", 2, G, G=G, R=1))
    # SHARE then SUMMED, whatever the size: the sums and copies are the workers' own CPU
    assert [(e.rounds, e.sent, e.received) for e in exchanges(tl, grads, shared=True)] == [(2, 0.0, 0.0)] * G


def test_gpipe_owners_compute_their_stage_and_exchange_nothing():
    tl = simulate(make_schedule("gpipe", 2, 4, G=1, R=2))
    assert end_of_step(tl, GRADS, LINK) == [0.0, 0.0]
    assert step_time(tl, GRADS, LINK) == tl.latency


def test_fsdp_sends_each_partial_to_its_owner():
    tl = simulate(make_schedule("fsdp", 2, 2, G=2, R=1))
    owner = [tl.owner[s * 2] for s in range(2)]  # one owner per stage
    assert sorted(owner) == [0, 1]
    # each worker sends its partial of the stage it does not own and receives the other's of its own
    tails = end_of_step(tl, GRADS, LINK)
    for w in range(2):
        mine = GRADS[owner.index(w)]
        other = GRADS[1 - owner.index(w)]
        assert tails[w] == pytest.approx(0.5 + max(mine, other) / 10.0)
    # a worker's exchange starts after its own last job
    finish = [max(tl.finish[j] for j in prog) for prog in tl.sequences]
    assert step_time(tl, GRADS, LINK) == pytest.approx(max(f + t for f, t in zip(finish, tails)))
