"""FSLPP's two owner formulas: the seeds' ``h(s, s)`` (the default) and the balanced
``h(s, floor(s / R))`` selected by ``strategy.ownership=balanced``."""

from __future__ import annotations

import itertools

import pytest
from hydra import compose, initialize_config_module

import launcher.config  # noqa: F401  (registers the schema)
from launcher.config import errors, to_schedule
from launcher.schedule import make_schedule, simulate
from launcher.schedule.metrics import summarize
from launcher.schedule.placement import FSLPP, h


@pytest.mark.parametrize("G, R", [(1, 1), (1, 4), (2, 2), (2, 4), (4, 2), (4, 4), (3, 2)])
def test_balanced_owner_is_a_compute_worker_and_shards_evenly(G, R):
    for S in (G * R, 2 * G * R):
        place = FSLPP(G, R, "balanced")
        for s in range(S):
            assert place.owner(s) == h(s, s // R, G, R)
            assert place.owner(s) in {h(s, b, G, R) for b in range(G)}  # one of stage s's compute workers
        owned = [sum(place.owner(s) == w for s in range(S)) for w in range(G * R)]
        assert owned == [S // (G * R)] * (G * R)


def test_seed_ownership_stays_the_default_and_leaves_workers_without_a_stage():
    assert make_schedule("fslpp", 8, 8, 2, 4).placement == FSLPP(2, 4, "seed")
    seed = summarize(simulate(make_schedule("fslpp", 8, 8, 2, 4)))["per_worker"]["weights_owned"]
    balanced = summarize(simulate(make_schedule("fslpp", 8, 8, 2, 4, ownership="balanced")))
    balanced = balanced["per_worker"]["weights_owned"]
    assert seed.count(0) == 4 and balanced == [1] * 8


def test_only_the_owner_moves_not_the_compute():
    for S, G, R in itertools.product((4, 8), (1, 2), (1, 2, 4)):
        a = simulate(make_schedule("fslpp", S, 4, G, R, ownership="seed"))
        b = simulate(make_schedule("fslpp", S, 4, G, R, ownership="balanced"))
        assert a.compute == b.compute and a.latency == b.latency


def test_one_config_key_reaches_make_step():
    with initialize_config_module("launcher.conf", version_base="1.3"):
        c = compose("config", overrides=["strategy=fslpp", "G=2", "R=4", "strategy.ownership=balanced"])
        assert errors(c) == []
        assert to_schedule(c).placement == FSLPP(2, 4, "balanced")
        assert to_schedule(compose("config", overrides=["strategy=fslpp"])).placement == FSLPP(2, 4, "seed")
        bad = compose("config", overrides=["strategy=lpp", "strategy.ownership=balanced"])
        assert errors(bad) == ["strategy.ownership=balanced is invalid for strategy=lpp: only strategy=fslpp "
                               "has a choice of owner; leave it at seed."]
        assert "strategy.ownership=x is invalid" in errors(compose("config", overrides=["strategy.ownership=x"]))[0]
