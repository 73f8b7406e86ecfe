"""The engine on real worker processes (gloo) equals single-process training, and its measured
counts equal the simulator's predictions, for every named scheme and order.

Every case runs inside one group of forked workers per module (starting a group is the expensive
part); each rank compares the stages it owns against the oracle trained beside it.
"""

from __future__ import annotations

import pytest

from launcher.runtime import launch, merge, mismatches
from launcher.runtime.oracle import Case, run_cases
from launcher.schedule.placement import FSLPP

ATOL = 1e-10


def overlapping_owners(s: int, b: int, d: str) -> tuple[int, int]:
    """Worker b runs micro-batch b on every stage; stage 0 is owned by workers 0 and 1, stage 1
    by 0 and 2 (worker 1 sends its partial sum to 0), stage 2 by all three."""
    owners = {0: (0, 1), 1: (0, 2), 2: (0, 1, 2)}[s]
    return (b if b in owners else 0), b
SCHEMES = [("ddp", 4, 1, 3, 4), ("fsdp", 4, 1, 4, 4), ("gpipe", 1, 4, 4, 6), ("lpp", 2, 2, 4, 4), ("fslpp", 2, 2, 4, 4)]
ORDERS = ["1f1b", "breadth_first", "depth_first"]

CASES_W4 = (
    [Case(n, G, R, S, B, order=o, optimizer=opt)
     for n, G, R, S, B in SCHEMES for o in ORDERS for opt in ("sgd", "adam")]
    # S = 8 stages on 4 workers
    + [Case(n, G, R, 8, 4, order=o, optimizer="adam") for n, G, R in [("fsdp", 4, 1), ("lpp", 2, 2), ("fslpp", 2, 2)]
       for o in ("1f1b", "breadth_first")]
    # the split backward (I then W)
    + [Case(n, G, R, S, B, order=o, split=True) for n, G, R, S, B in SCHEMES for o in ("1f1b", "depth_first")]
    # fetched weights freed after every job, and the prefetch window at its extremes
    + [Case("fsdp", 4, 1, 4, 4, weight_cache="job"), Case("fslpp", 2, 2, 8, 4, weight_cache="job", optimizer="adam"),
       Case("fslpp", 2, 2, 4, 4, weight_cache="job", split=True), Case("fslpp", 2, 2, 8, 4, prefetch=0),
       Case("lpp", 2, 2, 8, 8, prefetch=6, order="breadth_first"),
       # peak resident copies under cache job depend on the lookahead (and on I keeping its copy for W)
       Case("fsdp", 4, 1, 4, 4, weight_cache="job", prefetch=2),
       Case("fsdp", 4, 1, 4, 4, weight_cache="job", prefetch=0, split=True),
       Case("fslpp", 2, 2, 8, 4, weight_cache="job", prefetch=3, split=True, order="breadth_first")]
    # FSLPP's balanced ownership h(s, floor(s/R)): every worker owns a stage (S = G R) or two (S = 2 G R)
    + [Case("fslpp_balanced", 2, 2, 4, 4, optimizer="adam", placement=FSLPP(2, 2, "balanced"), W=4),
       Case("fslpp_balanced", 2, 2, 8, 4, weight_cache="job", placement=FSLPP(2, 2, "balanced"), W=4)]
    # Megatron's interleaved 1F1B on looped pipelines: each worker follows its sequence strictly
    + [Case("lpp", 1, 4, 8, 8, order="interleaved_1f1b", optimizer="adam"),
       Case("fslpp", 2, 2, 8, 4, order="interleaved_1f1b", split=True)]
    # ZB-H1: split backward, weight-gradient jobs deferred by up to the stage index
    + [Case("gpipe", 1, 4, 4, 8, order="zb_h1", split=True)]
    # ZB-H2: a longer warm-up (2p - 1 micro-batches on the first worker), W jobs at the tail
    + [Case("gpipe", 1, 4, 4, 8, order="zb_h2", split=True), Case("gpipe", 1, 4, 4, 3, order="zb_h2", split=True)]
    # the automatic schedule: each worker's searched sequence, run strictly
    + [Case("gpipe", 1, 4, 4, 8, order="auto", split=True)]
    # replicas' all-reduce: a bucket per stage, launched mid-step (gloo's collective) rather than
    # at the end (through a root: small); three replicas (not a power of two) on a subgroup of the four
    + [Case("ddp", 4, 1, 3, 4, bucket_bytes=1), Case("lpp", 2, 2, 8, 8, order="breadth_first", bucket_bytes=1),
       Case("ddp", 3, 1, 3, 3), Case("ddp", 3, 1, 3, 3, bucket_bytes=1, optimizer="adam")]
    # every case above sends its activations and gradients as a user's run does (transport auto:
    # shared memory between these workers on one host); these go over gloo instead (turned off:
    # the other transport, a user's choice across hosts): looped, split, fetched weights freed per
    # job, a deep prefetch
    + [Case("lpp", 1, 4, 8, 8, order="interleaved_1f1b", optimizer="adam", transport="gloo"),
       Case("gpipe", 1, 4, 4, 8, order="zb_h1", split=True, transport="gloo"),
       Case("fslpp", 2, 2, 8, 4, weight_cache="job", optimizer="adam", transport="gloo"),
       Case("lpp", 2, 2, 8, 8, prefetch=6, order="breadth_first", transport="gloo")]
    # a worker in several owner sets whose buckets end the step in both ways: worker 0 reduces
    # stage 0 (with 1) point to point at the end, and stage 1 (with 2, after 1's partial sum
    # arrives) by gloo's collective, which worker 2 launches during its backward
    + [Case("overlapping_owners", 3, 1, 3, 3, placement=overlapping_owners, W=3, bucket_bytes=1)]
)
CASES_W8 = [
    Case("ddp", 8, 1, 3, 8), Case("gpipe", 1, 8, 8, 8, order="breadth_first", optimizer="adam"),
    Case("lpp", 2, 4, 8, 8, optimizer="adam"), Case("fslpp", 4, 2, 4, 8, order="depth_first", split=True),
    Case("fsdp", 8, 1, 4, 8, weight_cache="job"),
]

# the V shape: worker w holds stages w and 2W-1-w, so stage W-1 hands its activation (and stage W
# its gradient) to its own worker; ZB-V and DualPipeV follow PyTorch's sequences strictly
CASES_VSHAPE = [Case("vshape", 1, 4, 8, 8, order="1f1b", optimizer="adam"),
                Case("vshape", 1, 4, 8, 8, order="1f1b", split=True),
                Case("vshape", 1, 4, 8, 8, order="zbv", split=True, optimizer="adam"),
                Case("vshape", 1, 2, 4, 3, order="zbv", split=True),
                Case("vshape", 1, 4, 8, 8, order="dualpipev", split=True, optimizer="adam"),
                Case("vshape", 1, 2, 4, 5, order="dualpipev", split=True)]


def _run(cases: list[Case], W: int) -> dict[str, tuple[Case, list[dict]]]:
    per_rank = launch(run_cases, W, cases, timeout=20, deadline=240)
    return {c.name: (c, [r[i] for r in per_rank]) for i, c in enumerate(cases)}


@pytest.fixture(scope="module")
def results_w4():
    return _run(CASES_W4, 4)


@pytest.fixture(scope="module")
def results_vshape():
    return _run(CASES_VSHAPE, 4)


@pytest.fixture(scope="module")
def results_w8():
    return _run(CASES_W8, 8)


def _check(case: Case, ranks: list[dict]) -> None:
    W = case.W or case.G * case.R
    ranks = ranks[:W]
    owned = sorted({s for r in ranks for s in r["owned"]})
    assert owned == list(range(case.S)), f"{case.name}: stages {owned} have owners, expected all {case.S}"
    grad_err = max(r["grad_err"] for r in ranks)
    param_err = max(r["param_err"] for r in ranks)
    assert grad_err <= ATOL and param_err <= ATOL, f"{case.name}: grad err {grad_err:.3g}, param err {param_err:.3g}"
    for i in range(case.steps):
        rec = merge([r["records"][i] for r in ranks])
        bad = mismatches(rec)
        assert not bad, f"{case.name} step {i}: measured != predicted: {bad}"
        # weight messages: one per distinct stage (cache step) or per job (cache job)
        fetch_key = "weight_fetch_stages" if case.weight_cache == "step" else "weight_fetch_jobs"
        assert rec["measured_only"]["weight_fetches"] == rec["per_worker"][fetch_key]["predicted"]
        assert all(b > 0 for b in rec["measured_only"]["peak_activation_bytes"])
        # copies resident at once, both caches (under "job", as the plan predicts for the lookahead)
        pw = rec["per_worker"]["weights_peak_resident"]
        assert pw["measured"] == pw["predicted"], f"{case.name} step {i}: peak resident weights {pw}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES_W4, ids=lambda c: c.name)
def test_oracle_w4(results_w4, case):
    _check(*results_w4[case.name])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES_W8, ids=lambda c: c.name)
def test_oracle_w8(results_w8, case):
    _check(*results_w8[case.name])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES_VSHAPE, ids=lambda c: c.name)
def test_oracle_vshape(results_vshape, case):
    _check(*results_vshape[case.name])
