"""The one memory model (:mod:`launcher.schedule.activations`) against real workers: for every
order on the split backward (``I`` frees a micro-batch's input, ``W`` its graph), each worker's
measured peak activation bytes equal the byte sweep's prediction, every step
(``tests/schedule/test_memory_model.py``: the units a limit bounds are that sweep)."""

from __future__ import annotations

import pytest

from runtime.test_recompute import RC, run_on_workers

ORDERS = ("1f1b", "breadth_first", "zb_h1", "zb_h2", "auto")
CASES = [RC("gpipe", 1, 4, 4, 8, split=True, order=o) for o in ORDERS]


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    return run_on_workers(CASES)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.order)
def test_measured_activation_bytes_are_the_prediction(results, case):
    ranks = results[case.name]
    assert max(r["err"] for r in ranks) <= 1e-10, f"{case.name}: parameters differ from the oracle"
    predicted = ranks[0]["predicted"]
    for r in ranks:
        assert r["peaks"], case.name
        for peak in r["peaks"]:  # every step, exactly (within 10% is what the issue asks)
            assert peak == predicted[r["worker"]], f"{case.name} worker {r['worker']}: {peak} != {predicted}"
