"""``mode=plan`` and ``strategy=auto``: the planner's best, re-simulated from its own Hydra
overrides, fits the budget and is at least as fast as every named scheme, G, R, order, split,
memory limit and FSLPP ownership that fits (a brute force over small problems)."""

from __future__ import annotations

import itertools
import json
import os
from functools import partial

import pytest

import launcher.config  # noqa: F401  (registers the schema)
from helpers.cli import run_launcher
from launcher.config import errors
from launcher.modes.simulation import simulate_config
from launcher.plan import Budget, ProfileError, load, memory, parse_bytes, search, unit
from launcher.plan.from_config import plan as plan_of
from launcher.plan.profile import from_dict
from launcher.plan.search import graph_shares, job_cache_time, shared_cores_time, time_bound
from launcher.schedule import ScheduleError, make_schedule, simulate
from launcher.schedule.activations import unit_peaks
from launcher.schedule.cores import job_work
from launcher.schedule.link import step_time as link_step_time
from launcher.schedule.metrics import per_worker
from launcher.schedule.overlap import steady_state

PROFILE = {"durations_s": {"F": 1.0, "B": 2.2, "I": 1.3, "W": 0.9}, "comm_s": 0.1,
           "bytes": {"params": [10, 20, 20, 10], "grads": [10, 20, 20, 10], "optimizer": [20, 40, 40, 20],
                     "activation": [5, 8, 8, 3]}}
ORDERS = [("1f1b", "classic"), ("1f1b", "none"), ("breadth_first", "none"), ("depth_first", "none"),
          ("zb_h1", "classic"), ("zb_h2", "classic"), ("interleaved_1f1b", "classic")]
VSHAPE_ORDERS = [("1f1b", "classic"), ("1f1b", "none"), ("zbv", "classic"), ("dualpipev", "classic")]


def fits(tl, prof, budget: Budget, caches=("step", "job")) -> bool:
    return bool(fitting(tl, prof, budget, caches))


def fitting(tl, prof, budget: Budget, caches=("step", "job")) -> list[str]:
    """The weight caches under which the step fits the budget (activations: the one memory model's units)."""
    if budget.activations is not None and max(unit_peaks(tl)) > budget.activations + 1e-9:
        return []
    if budget.bytes is None:
        return list(caches)
    owned, fetched = memory.owned_and_fetched(tl)
    act = memory.activation_bytes(tl, prof)
    return [c for c in caches if max(memory.worker_bytes(tl, prof, c, per_worker(tl, c)["weights_peak_resident"],
                                                         owned, fetched, act)) <= budget.bytes]


def brute_force(S: int, B: int, workers: int, prof, budget: Budget) -> float:
    """The fastest fitting step over every named scheme, G, R, named order (the V shape: 1F1B, ZB-V
    and DualPipeV), split, ownership and memory limit (none, or any uniform limit), simulated one by one,
    activations counted as the planner counts them (the profile's graph shares)."""
    best = float("inf")
    for scheme in ("ddp", "fsdp", "gpipe", "lpp", "fslpp", "vshape"):
        grs = {"ddp": [(B, 1)], "fsdp": [(B, 1)], "gpipe": [(1, S)], "vshape": [(1, S // 2)] if S % 2 == 0 else []}.get(
            scheme, [(G, R) for G in range(1, B + 1) for R in range(1, S + 1)])
        owns = ("seed", "balanced") if scheme == "fslpp" else ("seed",)
        orders = VSHAPE_ORDERS if scheme == "vshape" else ORDERS
        for (G, R), own, (order, warmup), split in itertools.product(grs, owns, orders, (False, True)):
            if G * R > workers or (order in ("zb_h1", "zb_h2", "zbv", "dualpipev") and not split) or (
                    order == "dualpipev" and B < S) or (
                    order == "interleaved_1f1b" and (scheme not in ("lpp", "fslpp") or not 1 < R < S or S % R)):
                continue
            for ml in [None, *range(1, S * B + 1)]:
                try:
                    tl = simulate(make_schedule(scheme, S, B, G, R, order=order, warmup=warmup, durations=dict(
                        prof.durations), comm=prof.comm, memory_limit=ml, split_backward=split, ownership=own,
                        graph_share=graph_shares(prof, S)))
                except ScheduleError:
                    continue
                for cache in fitting(tl, prof, budget):
                    best = min(best, step_time(tl, prof, cache))
    return best


def step_time(tl, prof, cache: str = "step") -> float:
    """The simulated step, and with a link the gradient exchange after it; on fewer cores than
    workers, the replay of the workers sharing them; plus the time outside the engine. Under
    cache "job", backwards on fetched weights recompute their forward."""
    grads = [prof.stage_bytes("grads", s) for s in range(tl.schedule.S)] if prof.link and prof.bytes else None
    if prof.cores is not None:
        base = shared_cores_time(tl, prof, grads)
    else:
        base = (link_step_time(tl, grads, prof.link) if grads else tl.latency) + prof.outside
    if cache == "job" and any(tl.owner[j] != tl.compute[j] for j in range(tl.schedule.space.N)):
        return job_cache_time(tl, prof, grads, dict(tl.schedule.durations), base)
    return base


LINKED = PROFILE | {"link": {"latency_s": 0.05, "bytes_per_s": 20.0}}
# workers that share 2 cores, with time outside the engine: more workers are not always faster
SHARED = LINKED | {"cores": 2, "outside_s": 0.3, "message_cpu_s": 0.05}

CASES = [  # S, B, workers, profile (None: unit costs), budget
    (4, 4, 4, None, Budget(activations=2)),
    (3, 4, 4, None, Budget()),
    (4, 4, 4, PROFILE, Budget(bytes=150)),
    (4, 4, 4, PROFILE, Budget(bytes=110)),
    (4, 3, 4, PROFILE, Budget(bytes=200, activations=3)),
    (4, 4, 2, PROFILE, Budget(bytes=300)),
    # a measured link: the gradient exchange after the compute ranks the schemes too
    (4, 4, 4, LINKED, Budget(bytes=150)),
    (4, 4, 4, LINKED, Budget()),
    (4, 4, 4, SHARED, Budget()),
    (4, 4, 4, SHARED, Budget(activations=2)),
    # on S / 2 workers: the V shape is the fastest at 2 activations, ZB-H2 at 3 with a profile
    (4, 4, 2, None, Budget(activations=2)),
    (4, 4, 2, PROFILE, Budget(activations=3)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: (
    f"S{c[0]}B{c[1]}w{c[2]}-{'link' if c[3] is LINKED else 'cores' if c[3] is SHARED else ''}{c[4]}"))
def test_best_reproduces_fits_and_beats_the_brute_force(case, cfg_of, tmp_path):
    S, B, workers, profile, budget = case
    prof = from_dict(profile) if profile else unit({"F": 1.0, "B": 1.0, "I": 0.5, "W": 0.5}, 0.0)
    best = search(S, [B], workers, prof, budget, top=5).best
    assert best is not None
    # re-simulate from the planner's own overrides, through Hydra
    cfg = cfg_of(best.overrides)
    assert errors(cfg) == []
    tl, summary = simulate_config(cfg)
    assert step_time(tl, prof, cfg.weight_cache) == pytest.approx(best.step_time, rel=1e-12)
    assert summary["workers"] <= workers
    assert fits(tl, prof, budget, caches=(cfg.weight_cache,))
    if best.peak_bytes is not None:
        owned, fetched = memory.owned_and_fetched(tl)
        again = memory.worker_bytes(tl, prof, cfg.weight_cache, summary["per_worker"]["weights_peak_resident"],
                                    owned, fetched, memory.activation_bytes(tl, prof))
        assert again == best.peak_bytes
    assert best.step_time <= brute_force(S, B, workers, prof, budget) * (1 + 1e-9)


def test_candidates_are_distinct_schedules():
    """Orders, limits or caches that give the same timeline (and the same weight traffic) are one
    candidate: re-simulated from its settings, no two listed candidates run the same schedule."""
    prof = unit({"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}, 0.0)
    plan = search(4, [8], 8, prof, Budget(activations=4), top=30)
    assert plan.equivalent > 0 and len(plan.candidates) > 5
    seen = set()
    for c in plan.candidates:
        p = c.point
        tl = simulate(make_schedule(p.scheme.name, 4, 8, p.G, p.R, order=p.order, warmup=p.warmup, durations=dict(
            prof.durations), comm=0.0, memory_limit=p.memory_limit, split_backward=p.split,
            ownership=p.scheme.ownership))
        fetches = any(per_worker(tl, "step")["weight_fetch_stages"])
        runs = (p.scheme, p.weight_cache if fetches else "step", p.split, p.G, p.R, tuple(map(tuple, tl.sequences)))
        assert runs not in seen, c.overrides
        seen.add(runs)


def test_no_bubble_is_zero_not_negative():
    """Durations that do not add up exactly in binary (0.1 + 0.2) leave a schedule without a bubble
    at 1 - busy / (W * latency) = -2e-16: recorded as 0 and printed 0.000, never -0.000."""
    from rich.console import Console

    from launcher.plan.table import candidates_table, describe

    plan = search(8, [16], 8, unit({"F": 0.1, "B": 0.2, "I": 0.1, "W": 0.1}, 0.0), Budget())
    assert plan.best is not None and min(c.bubble for c in plan.candidates) == 0.0
    con = Console(record=True, width=200)
    con.print(candidates_table(plan, seconds=False))
    shown = con.export_text() + describe(plan.best)
    assert "0.000" in shown and "-0.000" not in shown


def test_nothing_fits_gives_no_best():
    # on 2 workers every placement puts at least 2 stages of a micro-batch on a worker
    assert search(4, [4], 2, unit({"F": 1.0, "B": 1.0, "I": 0.5, "W": 0.5}, 0.0), Budget(activations=1)).best is None


def test_profiles_from_metrics_json_or_bare(tmp_path):
    bare = tmp_path / "profile.json"
    bare.write_text(json.dumps(PROFILE))
    metrics = tmp_path / "metrics.json"
    metrics.write_text(json.dumps({"latency": 1.0, "profile": PROFILE}))
    assert load(bare) == load(metrics)
    assert load(bare).can_split and load(bare).stage_bytes("activation", 1) == 8
    no_split = dict(PROFILE, durations_s={"F": 1.0, "B": 2.0, "I": None, "W": None})
    assert not from_dict(no_split).can_split
    with pytest.raises(ProfileError, match="durations_s"):
        from_dict({"comm_s": 0.0})
    with pytest.raises(ProfileError, match="cannot be read"):
        load(tmp_path / "missing.json")
    # a run on the split backward measures I and W, not B: B is their sum, and the profile splits
    split_only = dict(PROFILE, durations_s={"F": 1.0, "B": None, "I": 1.25, "W": 0.5},
                      stage_durations_s=[{"F": 1.0, "B": None, "I": 1.0, "W": 0.75}] * 4)
    prof = from_dict(split_only)
    assert prof.can_split and prof.durations["B"] == 1.75 and prof.stage_table(4)[0]["B"] == 1.75
    with pytest.raises(ProfileError, match="positive F and B"):
        from_dict(dict(PROFILE, durations_s={"F": 1.0, "B": None, "I": 1.25, "W": None}))


def test_a_shared_memory_reduce_is_priced_as_the_workers_ran_it():
    """A profile measured where the replicas all-reduced through shared memory (one host's CPUs,
    ``shared_reduce``) prices a replicated stage's all-reduce as two rounds of notices and no bytes
    over the link: ddp's step is shorter than over the link's ring, a placement with no replicas is
    priced the same either way, and a value that is not a bool is refused."""
    ring, shared = from_dict(SHARED), from_dict(SHARED | {"shared_reduce": True})
    assert not ring.shared_reduce and shared.shared_reduce
    for scheme, G, R, replicated in (("ddp", 4, 1, True), ("gpipe", 1, 4, False)):
        tl = simulate(make_schedule(scheme, 4, 4, G, R, durations=dict(ring.durations), comm=ring.comm))
        grads = [ring.stage_bytes("grads", s) for s in range(4)]
        t_ring, t_shared = shared_cores_time(tl, ring, grads), shared_cores_time(tl, shared, grads)
        assert (t_shared < t_ring) if replicated else (t_shared == t_ring), (scheme, t_shared, t_ring)
    with pytest.raises(ProfileError, match="shared_reduce='yes'"):
        from_dict(SHARED | {"shared_reduce": "yes"})


def test_sizes_parse():
    assert parse_bytes("2GB") == 2 * 10**9 and parse_bytes("512MiB") == 512 * 2**20 and parse_bytes(1000) == 1000
    assert parse_bytes("1.5e3") == 1500
    for bad in ("2 parsecs", "-1GB", "0"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_plan_keys_are_validated(cfg_of, tmp_path):
    bad = cfg_of(["mode=plan", "plan.memory=2GB"])
    assert errors(bad) == [
        "plan.memory=2GB needs plan.profile with bytes (params, grads, optimizer, activation per stage)."]
    assert errors(cfg_of(["mode=plan", "plan.microbatches=[4,0]"]))[0].startswith("plan.microbatches=[4, 0] is invalid")
    assert errors(cfg_of(["mode=plan", "plan.memory=lots", f"plan.profile={tmp_path}/none.json"]))[:1] == [
        "plan.memory=lots is invalid: give a size such as 2GB, 512MiB or a number of bytes."]
    assert errors(cfg_of(["mode=plan", "plan.max_activations=4", "plan.workers=16"])) == []


def test_plan_and_auto_on_the_command_line(tmp_path):
    """``mode=plan`` writes plan.json whose best reproduces under ``mode=simulate``; ``strategy=auto``
    simulates the same choice."""
    prof = tmp_path / "metrics.json"
    prof.write_text(json.dumps({"profile": PROFILE}))
    common = ["stages=4", "microbatches=4", "plan.workers=4", "plan.memory=150", f"plan.profile={prof}"]
    run = partial(run_launcher, cwd=tmp_path, env=os.environ, timeout=None)
    out = run("mode=plan", *common, f"hydra.run.dir={tmp_path / 'plan'}")
    assert out.returncode == 0, out.stderr
    rec = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert rec["best"] == rec["candidates"][0] and rec["best"]["overrides"]
    assert "top candidates" in out.stdout and "reproduce: python -m launcher mode=simulate" in out.stdout
    auto = run("mode=simulate", "strategy=auto", *common, f"hydra.run.dir={tmp_path / 'auto'}")
    assert auto.returncode == 0, auto.stderr
    assert "auto: chose " + " ".join(rec["best"]["overrides"]) in auto.stdout
    sim = json.loads((tmp_path / "auto" / "simulation.json").read_text())
    assert sim["latency"] == rec["best"]["step_time"]



UNIT = {"F": 1.0, "B": 1.0, "I": 0.5, "W": 0.5}  # the config's default durations


def test_time_bound_is_a_lower_bound_for_every_searched_order():
    """The bound that prunes the search holds for every order it tries, ZB-H2, auto and the V shape
    included: no simulated step is shorter (per-stage durations and a comm delay, limits or not)."""
    stages = [{"F": 1.0, "B": 2.0, "I": 1.2, "W": 0.8}, {"F": 0.7, "B": 1.6, "I": 0.9, "W": 0.7},
              {"F": 1.1, "B": 2.1, "I": 1.0, "W": 1.1}, {"F": 0.9, "B": 1.9, "I": 1.1, "W": 0.8}]
    d = {"F": 1.0, "B": 2.0, "I": 1.1, "W": 0.9}
    checked = set()
    for (G, R, v), B, per_stage, ml in itertools.product([(1, 4, False), (2, 2, False), (4, 1, False), (1, 3, False),
                                                           (1, 2, True)], (1, 4, 5), (None, stages), (None, 3)):
        if G > B:
            continue
        scheme = "vshape" if v else "lpp"
        for (order, warmup), split in itertools.product([*(VSHAPE_ORDERS if v else ORDERS), ("auto", "classic")],
                                                        (False, True)):
            if not split and order in ("zb_h1", "zb_h2", "zbv", "dualpipev", "auto") or (
                    order == "interleaved_1f1b" and R != 2 or order == "dualpipev" and B < 4):
                continue
            try:
                tl = simulate(make_schedule(scheme, 4, B, G, R, order=order, warmup=warmup, durations=d, comm=0.25,
                                        memory_limit=ml, split_backward=split, stage_durations=per_stage))
            except ScheduleError:
                continue
            assert tl.latency >= time_bound(4, B, G, R, split, d, 0.25, per_stage, vshape=v) * (1 - 1e-12), (
                scheme, G, R, B, order, split, ml)
            checked.add((scheme, order))
    want = {("lpp", "zb_h2"), ("lpp", "auto"), ("vshape", "zbv"), ("vshape", "dualpipev"), ("vshape", "1f1b")}
    assert want <= checked


def test_auto_is_the_best_where_it_is_fastest(cfg_of):
    """The default durations on 4 workers, 4 stages, 8 micro-batches, 3 activation units: order=auto's
    search finds a step of 18 units, the named orders 22.5 at best (1F1B on the split backward).
    ZB-H2 (19 units without a limit) holds every micro-batch's graph until its tail of W jobs: 8
    units on every worker, by the one memory model, so it does not fit. The plan lists auto first,
    and its overrides reproduce it under mode=simulate within the budget."""
    cfg = cfg_of(["mode=plan", "stages=4", "microbatches=8", "plan.workers=4", "plan.max_activations=3"])
    found = plan_of(cfg)
    best = found.best
    assert best is not None and best.point.order == "auto" and best.step_time == 18.0
    assert found.auto_searched > 0
    named = search(4, [8], 4, unit(UNIT, 0.0), Budget(activations=3), auto_top=0).best
    assert named is not None and named.point.order == "1f1b" and named.step_time == 22.5
    zb_h2 = simulate(make_schedule("gpipe", 4, 8, 1, 4, order="zb_h2", split_backward=True))
    assert zb_h2.latency == 19.0 and unit_peaks(zb_h2) == [8.0] * 4
    again = cfg_of(["mode=simulate", *best.overrides])
    assert errors(again) == []
    tl, summary = simulate_config(again)
    assert tl.latency == best.step_time and max(summary["per_worker"]["peak_activation_units"]) <= 3


@pytest.mark.parametrize("S, B, workers, profile, budget", [
    (4, 8, 4, None, Budget(activations=3)), (4, 4, 2, None, Budget(activations=3)),
    (4, 4, 4, PROFILE, Budget(bytes=150)), (4, 4, 4, LINKED, Budget()), (6, 6, 3, PROFILE, Budget(activations=4))])
def test_the_plan_is_never_slower_than_the_named_orders(S, B, workers, profile, budget):
    """order=auto is searched on top of the named orders (a superset), so the best never loses."""
    prof = from_dict(profile) if profile else unit(UNIT, 0.0)
    best = search(S, [B], workers, prof, budget, top=5).best
    named = search(S, [B], workers, prof, budget, top=5, auto_top=0).best
    assert best is not None and named is not None and named.point.order != "auto"
    assert best.step_time <= named.step_time


def test_the_v_shape_is_planned_and_reproduces(cfg_of):
    """On S / 2 workers with 2 activation units each, from a profile whose stages keep no graph
    beyond their inputs (graph_share 0: an input freed at I frees the whole unit), the V shape
    (worker w holds stages w and S - 1 - w) is the fastest; its overrides (strategy=vshape G=1 R=S/2,
    with the profile's graph_share) reproduce it within the budget, and ZB-V is among the candidates
    where the budget allows its warm-up. (Under the default count, every graph kept until W, the
    looped pipeline wins at this budget.)"""
    prof = from_dict({"durations_s": UNIT, "comm_s": 0.0,
                      "bytes": {k: [1] * 4 for k in ("params", "grads", "optimizer", "activation")}})
    best = search(4, [4], 2, prof, Budget(activations=2)).best
    assert best is not None and (best.point.scheme.name, best.point.G, best.point.R) == ("vshape", 1, 2)
    assert "graph_share=0.0" in best.overrides
    cfg = cfg_of(["mode=simulate", *best.overrides])
    assert errors(cfg) == []
    tl, summary = simulate_config(cfg)
    assert tl.latency == best.step_time and max(summary["per_worker"]["peak_activation_units"]) <= 2
    lpp = search(4, [4], 2, prof, Budget(activations=2), top=50).candidates
    assert best.step_time < min(c.step_time for c in lpp if c.point.scheme.name != "vshape")
    orders = {c.point.order for c in search(4, [8], 2, prof, Budget(), top=100).candidates
              if c.point.scheme.name == "vshape"}
    assert "zbv" in orders


@pytest.mark.parametrize("budget", ["plan.max_activations=3", "plan.max_activations=8"])
def test_overlapped_steps_are_ranked_by_their_steady_state(cfg_of, budget):
    """``step_overlap=post_validation``: candidates are ranked by the steady state's step cost
    (:mod:`launcher.schedule.overlap`); the best's overrides carry the rule and reproduce its cost
    under mode=simulate; it is at most the partial state's ``W - 1`` hops slower than the barrier's
    best priced the same way (its makespan plus the step's all-reduce: mode=simulate's step cost under
    step_overlap=none; the runtime's chain, last worker to first, can cost more than one all-reduce),
    nor faster than the busiest worker's work (the bound left when steps overlap)."""
    common = ["mode=plan", "stages=4", "microbatches=8", "plan.workers=4", budget, "comm=0.25"]
    over = plan_of(cfg_of([*common, "step_overlap=post_validation"])).best
    barrier = plan_of(cfg_of(common)).best
    assert over is not None and barrier is not None
    assert "step_overlap=post_validation" in over.overrides
    again = cfg_of(["mode=simulate", *over.overrides])
    assert errors(again) == []
    _, summary = simulate_config(again)
    assert summary["step_cost"] == pytest.approx(over.step_time, rel=1e-12)
    _, behind = simulate_config(cfg_of(["mode=simulate", *barrier.overrides]))
    assert behind["step_overlap"] == "none" and over.step_time <= behind["step_cost"] + (4 - 1) * 0.25 + 1e-9
    p = over.point
    split = p.split
    d = dict(p.durations)
    assert over.step_time >= time_bound(4, 8, p.G, p.R, split, d, 0.25, work_only=True) - 1e-9


def test_overlapped_steps_share_the_cores(cfg_of):
    """``step_overlap=post_validation`` on a profile of workers that share 2 cores: the best's step
    time is its programs' steady state replayed on those cores (each job's work with its messages'
    CPU, each worker's time outside the engine at its step's end), and no less than the same
    programs' steady state with a core per worker plus that time (a candidate on 4 workers)."""
    prof = from_dict(SHARED)
    ranked = search(4, [4], 4, prof, Budget(), top=40, step_overlap="post_validation").candidates
    # the best on more workers than cores (the best overall may run on 2)
    best, tl = next((c, tl) for c in ranked for tl, _ in [simulate_config(cfg_of(c.overrides))]
                    if tl.schedule.workers > 2)
    assert "step_overlap=post_validation" in best.overrides
    work = job_work(tl, dict(tl.schedule.durations), prof.message_cpu, "step")
    W = tl.schedule.workers
    shared = steady_state(tl, "post_validation", cores=2, work=work, tails=[prof.outside] * W,
                          state_comm=prof.link.latency_s).step_cost
    assert best.step_time == pytest.approx(shared, rel=1e-12)
    assert W > 2 and shared >= steady_state(tl, "post_validation").step_cost + prof.outside - 1e-9
