"""Activation recomputation (``recompute=none|full|[stages]``): the engine's results equal
single-process training, each worker's measured peak activation bytes (inputs plus the forwards'
autograd graphs) equal the prediction exactly, the simulator charges the extra forward, a bad
value is one sentence, and the planner picks ``recompute=full`` when only that fits a budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from launcher.runtime import launch
from launcher.runtime.engine import Engine
from launcher.runtime.oracle import flat_params, mlp_batches, reference_step, staged_mlp
from launcher.schedule import StepError, make_schedule, simulate

ATOL = 1e-10


@dataclass(frozen=True)
class RC:
    """One engine run: a scheme, its sizes and the stages that recompute."""

    strategy: str
    G: int
    R: int
    S: int
    B: int
    recompute: object = "none"
    split: bool = False
    weight_cache: str = "step"
    order: str = "1f1b"

    @property
    def name(self) -> str:
        return (f"{self.strategy}-G{self.G}R{self.R}-S{self.S}B{self.B}-rc{self.recompute}"
                f"{'-split' if self.split else ''}{'-job' if self.weight_cache == 'job' else ''}-{self.order}")


def _run_one(c: RC, steps: int = 2) -> dict:
    step = make_schedule(c.strategy, c.S, c.B, G=c.G, R=c.R, order=c.order, split_backward=c.split,
                         recompute=c.recompute)

    def opt(ps: list) -> torch.optim.Optimizer:
        return torch.optim.SGD(ps, lr=0.1, momentum=0.9)

    engine = Engine(staged_mlp(c.S, width=16), step, opt, weight_cache=c.weight_cache)
    ref = staged_mlp(c.S, width=16)
    ref_opt = opt([p for m in ref.stages for p in m.parameters()])
    err, peaks, predicted = 0.0, [], None
    for i in range(steps):
        mbs = mlp_batches(c.B, seed=i)
        rec = engine.train_step(mbs)
        reference_step(ref, ref_opt, mbs)
        for s in engine.owned:
            err = max(err, (flat_params(engine.modules[s]) - flat_params(ref.stages[s])).abs().max().item())
        if rec:
            peaks.append(rec["measured_only"]["peak_activation_bytes"])
        predicted = engine.activation_peaks(mbs)
    return {"err": err, "peaks": peaks, "predicted": predicted, "worker": engine.worker}


def _run_all(cases: list[RC]) -> list[dict]:
    return [_run_one(c) for c in cases]


CASES = [
    RC("gpipe", 1, 4, 4, 4, "full"), RC("gpipe", 1, 4, 4, 4, [1, 3]), RC("gpipe", 1, 4, 4, 4, "none"),
    RC("fsdp", 4, 1, 4, 4, "full"), RC("fsdp", 4, 1, 4, 4, [0, 2]), RC("fsdp", 4, 1, 4, 4, "none"),
    RC("fsdp", 4, 1, 4, 4, "none", weight_cache="job"),
    RC("lpp", 2, 2, 4, 4, "full"), RC("lpp", 2, 2, 4, 4, [2]), RC("lpp", 2, 2, 4, 4, "none"),
    # split backward: I recomputes the forward and its graph stays until W
    RC("gpipe", 1, 4, 4, 4, "full", split=True), RC("lpp", 2, 2, 4, 4, [0, 3], split=True),
    RC("lpp", 2, 2, 4, 4, "none", split=True),
]


def run_on_workers(cases: list[RC]) -> dict[str, list[dict]]:
    """Every case on the same 4 workers, one launch: each case's per-rank results by its name."""
    per_rank = launch(_run_all, 4, cases, timeout=20, deadline=240)
    return {c.name: [r[i] for r in per_rank] for i, c in enumerate(cases)}


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    return run_on_workers(CASES)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_oracle_and_memory(results, case):
    ranks = results[case.name]
    assert max(r["err"] for r in ranks) <= ATOL, f"{case.name}: parameters differ from the oracle"
    predicted = ranks[0]["predicted"]
    for r in ranks:
        for peak in r["peaks"]:  # every step, exactly
            assert peak == predicted[r["worker"]], f"{case.name} worker {r['worker']}: {peak} != {predicted}"


@pytest.mark.timeout(300)
def test_recompute_lowers_the_peak(results):
    for none, full in [("gpipe-G1R4-S4B4-rcnone-1f1b", "gpipe-G1R4-S4B4-rcfull-1f1b"),
                       ("fsdp-G4R1-S4B4-rcnone-1f1b", "fsdp-G4R1-S4B4-rcfull-1f1b"),
                       ("lpp-G2R2-S4B4-rcnone-1f1b", "lpp-G2R2-S4B4-rcfull-1f1b"),
                       ("lpp-G2R2-S4B4-rcnone-split-1f1b", "gpipe-G1R4-S4B4-rcfull-split-1f1b")]:
        a, b = results[none][0]["predicted"], results[full][0]["predicted"]
        assert max(b) < max(a), f"{full}: peak {max(b)} is not below {none}'s {max(a)}"


def test_simulator_charges_the_extra_forward():
    # GPipe fill-drain, S stages, B micro-batches, F = f, B = g: latency (S + B - 1)(f + g) with one
    # stage's forward added to every backward under recompute=full: (S + B - 1)(2f + g)
    S, B, f, g = 4, 6, 1.0, 2.0
    for rc, want in [("none", (S + B - 1) * (f + g)), ("full", (S + B - 1) * (2 * f + g))]:
        tl = simulate(make_schedule("gpipe", S, B, G=1, R=S, order="breadth_first", durations={"F": f, "B": g},
                                recompute=rc))
        assert tl.latency == want, (rc, tl.latency, want)
    # only stage 1 recomputes: its backwards take f more
    step = make_schedule("gpipe", S, B, G=1, R=S, durations={"F": f, "B": g}, recompute=[1])
    table = step.duration_table()
    assert table[S + 1] == g + f and table[S] == table[S + 2] == g
    # split backward: I carries it
    step = make_schedule("gpipe", S, B, G=1, R=S, split_backward=True, durations={"F": 1, "I": 0.5, "W": 0.5},
                     recompute="full")
    assert step.duration_table()[S:2 * S] == [1.5] * S and step.duration_table()[2 * S:] == [0.5] * S


@pytest.mark.parametrize("value,says", [
    ([9], "recompute=[9] is invalid: stage 9 does not exist with stages=8; use none, full (every stage) or a list of "
          "stage indices in [0, 8)."),
    ("some", "recompute=some is invalid: use none, full (every stage) or a list of stage indices."),
    ([1, -1], "recompute=[1, -1] is invalid: -1 is not a stage index; use none, full (every stage) or a list of stage "
              "indices."),
    ([2, 2], "recompute=[2, 2] is invalid: it names a stage twice; use none, full (every stage) or a list of stage "
             "indices."),
])
def test_bad_values_are_one_sentence(value, says):
    from omegaconf import OmegaConf

    from launcher.config.schema import LauncherConf
    from launcher.config.validate import errors

    cfg = OmegaConf.structured(LauncherConf)
    cfg.recompute = value
    found = [e for e in errors(cfg) if e.startswith("recompute")]
    assert found == [says]
    with pytest.raises(StepError) as e:
        make_schedule("lpp", 8, 16, G=2, R=4, recompute=value)
    assert e.value.sentences == [says]


def test_config_reaches_the_step():
    from omegaconf import OmegaConf

    from launcher.config import to_schedule
    from launcher.config.schema import LauncherConf

    cfg = OmegaConf.structured(LauncherConf)
    cfg.model = cfg.data = cfg.trainer = cfg.logger = None
    assert to_schedule(cfg).recompute == frozenset()
    cfg.recompute = [0, 5]
    assert to_schedule(cfg).recompute == frozenset({0, 5})
    cfg.recompute = "full"
    assert to_schedule(cfg).recompute == frozenset(range(8))


def test_planner_picks_recompute_when_only_it_fits():
    from launcher.plan import Budget, search
    from launcher.plan.profile import from_dict

    raw = {"durations_s": {"F": 1.0, "B": 2.0, "I": 1.2, "W": 0.8}, "comm_s": 0.1,
           "bytes": {"params": [10, 20, 20, 10], "grads": [10, 20, 20, 10], "optimizer": [20, 40, 40, 20],
                     "activation": [5, 8, 8, 3], "saved": [60, 90, 90, 40]}}
    prof = from_dict(raw)
    # one worker holds every stage of a micro-batch: with one micro-batch in flight its least peak
    # is the static 240 bytes plus, without recomputation, every input and graph (24 + 280), and
    # with it, at most, stage 2's backward: the inputs of stages 0-2, its rebuilt graph and the
    # weight gradient it returns before adding it into the stage's sum (21 + 90 + 20)
    budget = Budget(bytes=240 + 24 + 200)
    plan = search(4, [4], 1, prof, budget)
    assert plan.candidates and all(c.point.recompute == "full" for c in plan.candidates)
    assert "recompute=full" in plan.best.overrides and max(plan.best.peak_bytes) <= budget.bytes
    assert min(max(c.peak_bytes) for c in plan.candidates) == 240 + 21 + 90 + 20
    # without a budget recomputation only costs time: never chosen
    assert search(4, [4], 4, prof, Budget()).best.point.recompute == "none"
    # an older profile (no saved bytes) is read and never searches it
    old = old_profile(raw)
    assert all(c.point.recompute == "none" for c in search(4, [4], 4, old, Budget(bytes=1e12), top=1000).candidates)


def old_profile(raw: dict):
    """``raw`` as a profile written before the ``saved`` bytes existed."""
    from launcher.plan.profile import from_dict

    return from_dict({**raw, "bytes": {k: v for k, v in raw["bytes"].items() if k != "saved"}})


def _counted_per_step(check_batches: object) -> dict:
    """Forwards whose saved bytes were hooked, per step, on a worker of a 2-worker looped pipeline of 4
    stages (stage 1 recomputes, so its backward's rebuilt graph is counted too), micro-batches of 4
    rows for three steps, then 5 rows for two; and each step's measured peak against the prediction."""
    step = make_schedule("lpp", 4, 4, G=1, R=2, recompute=[1])
    engine = Engine(staged_mlp(4, width=16), step, lambda ps: torch.optim.SGD(ps, lr=0.1), check_batches=check_batches)
    taken, exact = [], []
    for i, rows in enumerate([4, 4, 4, 5, 5]):
        mbs = mlp_batches(4, size=rows, seed=i)
        before = engine.graph_counts.taken
        rec = engine.train_step(mbs)
        taken.append(engine.graph_counts.taken - before)
        exact.append(rec["measured_only"]["peak_activation_bytes"] == engine.activation_peaks(mbs)[engine.worker])
    return {"taken": taken, "exact": exact}


def _counted_runs() -> list[dict]:
    return [_counted_per_step(True), _counted_per_step(1)]


@pytest.mark.timeout(300)
def test_saved_bytes_are_counted_once_per_shape():
    # each worker runs 2 stages x 4 micro-batches of counted forwards (F of stage 0 or 2, the
    # recomputing backward of stage 1, F of stage 3): all are hooked on step 1 (a check step),
    # none on steps 2-3 (same shapes), the first two of each of its 2 keys when the micro-batch
    # grows to 5 rows, none after; every step's peak is still the prediction, exactly
    for cached, every in launch(_counted_runs, 2, timeout=20, deadline=240):
        assert cached["taken"] == [8, 0, 0, 4, 0], cached
        assert every["taken"] == [8] * 5, every  # check_batches=1: every step is a check step
        assert all(cached["exact"]) and all(every["exact"]), (cached, every)


def test_graph_counts_trust_two_agreeing_counts():
    from launcher.runtime.saved import GraphCounts, Known

    counts = GraphCounts()
    x = torch.randn(3, 4, requires_grad=True)

    def forward(key: object, recount: bool = False) -> int:
        with counts.counter(key, recount, lambda: [x]) as graph:
            (x.exp() * 2).sum()
        return graph.nbytes

    n = forward("a")
    assert forward("a") == n and counts.taken == 2  # the second count confirms the first
    assert isinstance(counts.counter("a", False, lambda: [x]), Known) and forward("a") == n and counts.taken == 2
    assert forward("a", recount=True) == n and counts.taken == 3  # a check step counts again
    counts.record("a", n + 8)  # a recount that differs: counted again until two agree
    assert forward("a") == n and forward("a") == n and counts.taken == 5 and forward("a") == n and counts.taken == 5
    assert forward(None) == n and forward(None) == n and counts.taken == 7  # no key: always counted
