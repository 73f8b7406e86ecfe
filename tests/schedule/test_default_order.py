"""Each scheme's default order (docs/configuration.md, "Default orders"): ``interleaved_1f1b`` on a
looped pipeline where it is valid, else ``1f1b`` with the reason; an order a user names is kept."""

from __future__ import annotations

import pytest

from launcher.schedule import make_schedule
from launcher.schedule.settings import Settings


@pytest.mark.parametrize("scheme,G,R,S,B,extra,want", [
    ("lpp", 1, 2, 4, 8, {}, "interleaved_1f1b"),  # the pair
    ("fslpp", 4, 4, 8, 16, {}, "interleaved_1f1b"),  # the flagship
    ("lpp", 1, 2, 4, 3, {}, "interleaved_1f1b"),  # B not a multiple of R: a shorter last round, still valid
    ("lpp", 2, 2, 4, 4, {"split_backward": True}, "1f1b"),
    ("lpp", 1, 2, 4, 8, {"memory_limit": 4}, "1f1b"),
    ("lpp", 1, 4, 4, 8, {}, "1f1b"),  # R = stages: no loop
    ("lpp", 2, 1, 4, 8, {}, "1f1b"),  # R = 1: no pipeline
    ("fslpp", 1, 3, 4, 8, {}, "1f1b"),  # stages not a multiple of R
    ("gpipe", None, None, 4, 8, {}, "1f1b"),
    ("vshape", None, None, 4, 8, {}, "1f1b"),
    ("ddp", None, None, 4, 4, {}, "1f1b"),
])
def test_default_order(scheme, G, R, S, B, extra, want):
    step = make_schedule(scheme, S, B, G=G, R=R, **extra)
    assert step.order.name == want and step.order.warmup == "classic"
    name, why = Settings.of(scheme, S, B, G, R, **extra).default_order()
    assert name == want and why  # a reason in words, also for the fallback
    if want == "1f1b" and scheme in ("lpp", "fslpp"):
        assert "interleaved_1f1b" in why


def test_a_named_order_is_kept():
    assert make_schedule("lpp", 4, 8, G=1, R=2, order="1f1b").order.name == "1f1b"
    assert make_schedule("lpp", 4, 8, G=1, R=2, order="breadth_first").order.name == "breadth_first"
    assert Settings(scheme="ddp", G=4, R=1, stages=4, microbatches=4).ignored() == []  # no order named: no warning
    assert Settings(scheme="ddp", G=4, R=1, stages=4, microbatches=4, order="1f1b").ignored()  # named: warned
