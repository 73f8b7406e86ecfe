"""The timeline checker of :mod:`helpers.schedules` catches what it claims to, so a green
property test means something."""

from __future__ import annotations

import copy

import pytest

from helpers.schedules import check_timeline
from launcher.schedule import make_schedule, simulate


def _tl():
    return simulate(make_schedule("gpipe", 3, 4, G=1, R=3, order="1f1b", comm=0.5))


def test_checker_accepts_a_valid_timeline():
    check_timeline(_tl())


def test_checker_catches_a_job_that_starts_before_its_predecessor():
    tl = copy.deepcopy(_tl())
    j = tl.schedule.space.id(1, 0, "F")
    tl.start[j] -= 0.25
    tl.finish[j] -= 0.25
    with pytest.raises(AssertionError, match="before its predecessor"):
        check_timeline(tl)


def test_checker_catches_overlapping_jobs_on_a_worker():
    tl = copy.deepcopy(_tl())
    j = tl.sequences[0][1]
    tl.start[j] -= 0.5
    tl.finish[j] -= 0.5
    with pytest.raises(AssertionError):
        check_timeline(tl)


def test_checker_catches_a_job_run_twice():
    tl = copy.deepcopy(_tl())
    tl.sequences[0].append(tl.sequences[0][0])
    with pytest.raises(AssertionError, match="exactly once"):
        check_timeline(tl)
