"""The simulator's profile from the workers' records leaves out an epoch's last, smaller batch."""

from __future__ import annotations

from launcher.report.measured_costs import job_seconds


def _record(forward_s: float, short: bool = False) -> dict:
    """A GPU worker's record of a step with one forward job taking ``forward_s``."""
    measured = {"device": "cuda", "jobs": [[0, 0, "F", forward_s, 0.0, 0.0]]}
    if short:
        measured["short_batch"] = True
    return {"measured_only": measured}


def test_a_short_last_batch_is_left_out_of_job_times() -> None:
    # the first step (warm-up) and the short one do not count: the mean is the full step's 1.0, not 0.55
    steps = [_record(9.0), _record(1.0), _record(0.1, short=True)]
    assert job_seconds([{"records": steps}], ["F"]) == {"F": 1.0}
    # a run of short batches only (a data set smaller than one batch): they are all there is
    assert job_seconds([{"records": [_record(9.0, True), _record(0.5, True)]}], ["F"]) == {"F": 0.5}
