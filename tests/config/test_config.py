"""The Hydra config layer, composed in-process: group defaults, the schema, every validation rule
(one sentence each, naming key and value), the command-line pre-check, and config -> Schedule."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import launcher.config  # noqa: F401  (registers the schema and the resolver)
from launcher.config import ConfigError, check_overrides, errors, to_schedule
from launcher.config.spec import settings_of
from launcher.config.validate import check_sweep_overrides
from launcher.modes.simulation import simulate_config
from launcher.schedule import make_schedule, simulate
from launcher.schedule.schemes import SCHEMES

#: the registries' names as the sentences list them (every scheme and order, from one place)
NAMED_SCHEMES = ", ".join(sorted(SCHEMES))

#: the order group's options as the command line lists them (every file of conf/order but the callable's)
ORDER_GROUP = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "order").glob("*.yaml")
                     if p.stem != "custom")


def test_defaults_compose_and_are_valid(cfg_of):
    c = cfg_of()
    assert (c.mode, c.strategy.name, c.order.name) == ("train", "lpp", "default")
    assert settings_of(c).order_name == "interleaved_1f1b"  # lpp G=2 R=4 on 8 stages: a looped pipeline
    assert (c.G, c.R, c.W, c.stages, c.microbatches) == (2, 4, 8, 8, 16)
    assert dict(c.durations) == {"F": 1.0, "B": 1.0, "I": 0.5, "W": 0.5}
    assert (c.comm, c.memory_limit, c.warmup, c.split_backward, c.weight_cache, c.prefetch) == (
        0.0, None, None, False, "step", 1)
    assert errors(c) == []


@pytest.mark.parametrize(
    "overrides, G, R",
    [
        (["strategy=ddp"], 16, 1),
        (["strategy=fsdp", "microbatches=6"], 6, 1),  # G follows microbatches
        (["strategy=gpipe", "stages=5"], 1, 5),  # R follows stages
        (["strategy=fslpp", "G=4", "R=4"], 4, 4),  # as written in the design
        (["strategy=ddp", "G=8", "R=2"], 8, 2),  # the command line wins over the group file
        (["strategy=gpipe", "R=2", "G=4", "stages=8"], 4, 2),
    ],
)
def test_strategy_defaults_and_command_line_wins(cfg_of, overrides, G, R):
    c = cfg_of(*overrides)
    assert (c.G, c.R, c.W) == (G, R, G * R)
    assert errors(c) == []


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["W=5"], "W=5 is invalid: W must equal G*R = 2*4 = 8."),
        (["R=9"], "R=9 is invalid: R must not exceed stages=8"),
        (["G=17"], "G=17 is invalid: G must not exceed microbatches=16"),
        (["strategy=ddp", "G=2", "R=4"], "strategy=ddp needs W = microbatches, but W=G*R=8 and microbatches=16"),
        (["strategy=fsdp", "G=4"], "strategy=fsdp needs W = microbatches, but W=G*R=4 and microbatches=16"),
        (["strategy=gpipe", "G=2"], "strategy=gpipe needs W = stages, but W=G*R=16 and stages=8"),
        (["G=0"], "G=0 is invalid: the sizes G, R, stages and microbatches must be positive integers."),
        (["stages=-1"], "stages=-1 is invalid"),
        (["microbatches=0"], "microbatches=0 is invalid"),
        (["mode=fly"], "mode=fly is not a known mode"),
        (["strategy.name=foo"], "strategy=foo is not a known strategy"),
        (["order.name=bar"], "order=bar is not a known order"),
        (["strategy=custom"], "strategy.placement._target_=(not set) is invalid"),
        (["order=custom"], "order.n._target_=(not set) is invalid"),
        (["memory_limit=0"], "memory_limit=0 is invalid"),
        (["memory_limit=[2,2]"], "memory_limit=[2, 2] is invalid: it has 2 entries but there are W=8 workers"),
        (["memory_limit=[2,2,2,2,2,2,2,x]"], "memory_limit=[2, 2, 2, 2, 2, 2, 2, 'x'] is invalid"),
        (["warmup=later"], "warmup=later is invalid"),
        (["weight_cache=forever"], "weight_cache=forever is invalid"),
        (["durations.F=0"], "durations.F=0.0 is invalid: job durations must be positive finite numbers."),
        (["comm=-1"], "comm=-1.0 is invalid"),
        (["prefetch=-1"], "prefetch=-1 is invalid"),
    ],
)
def test_each_rule_is_one_sentence_naming_key_and_value(cfg_of, overrides, expected):
    found = errors(cfg_of(*overrides))
    assert len(found) == 1, found
    assert found[0].startswith(expected), found
    assert "\n" not in found[0] and found[0].endswith(".")


def test_all_failures_are_reported(cfg_of):
    found = errors(cfg_of("mode=fly", "R=9", "G=17", "comm=-1"))
    assert [f.split("=")[0] for f in found] == ["mode", "R", "G", "comm"]


def test_validate_plain_mapping_catches_non_integer_sizes():
    c = OmegaConf.to_container(OmegaConf.structured(launcher.config.LauncherConf), resolve=True)
    c.update(G=2.5, R="4")
    found = errors(c)
    assert found[:2] == [
        "G=2.5 is invalid: the sizes G, R, stages and microbatches must be positive integers.",
        "R=4 is invalid: the sizes G, R, stages and microbatches must be positive integers.",
    ]


def test_memory_limit_that_cannot_finish_is_one_sentence(cfg_of):
    with pytest.raises(ConfigError) as e:
        simulate_config(cfg_of("memory_limit=1"))  # LPP G=2 R=4 on 8 stages: 2 stages per worker
    (sentence,) = e.value.sentences
    assert sentence.startswith("memory_limit=1 on worker 0 cannot finish the step") and "\n" not in sentence


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["strategy=foo"], [
            f"strategy=foo is not a known strategy; choose one of {NAMED_SCHEMES}, or a placement "
            "callable (strategy=custom with strategy.placement._target_); the launcher also takes strategy=auto "
            "(the planner chooses) and strategy=single (Lightning's default strategy on one device)."]),
        (["-m", "strategy=ddp,foo"], None),  # "-m" is not an override: parsed away by the CLI
        (["order=lifo"], [f"order=lifo is not a known order; choose one of {', '.join(ORDER_GROUP)}, or an order "
                          "callable (order=custom with order.n._target_)."]),
        (["G=2.5"], ["G=2.5 is invalid: the sizes G, R, stages and microbatches must be positive integers."]),
        (["R=1,x"], ["R=x is invalid: the sizes G, R, stages and microbatches must be positive integers."]),
        (["comm=abc"], ["comm=abc is invalid: the communication delay must be a finite number >= 0."]),
        (["split_backward=maybe"], ["split_backward=maybe is invalid: it must be true or false."]),
        (["colour=red"], ["colour=red is invalid: colour is not a known key."]),
    ],
)
def test_command_line_precheck(overrides, expected):
    if expected is None:
        assert check_overrides(["strategy=ddp,foo"]) == [
            f"strategy=foo is not a known strategy; choose one of {NAMED_SCHEMES}, or a placement "
            "callable (strategy=custom with strategy.placement._target_); the launcher also takes strategy=auto "
            "(the planner chooses) and strategy=single (Lightning's default strategy on one device)."]
    else:
        assert check_overrides(overrides) == expected


@pytest.mark.parametrize(
    "overrides, kept, skipped",
    [
        (["strategy=lpp,foo", "stages=8"], ["strategy=lpp", "stages=8"], ["strategy=foo"]),
        (["G=2,2.5,4", "R=1"], ["G=2,4", "R=1"], ["G=2.5"]),
        (["G=choice(1,x,2)"], ["G=1,2"], ["G=x"]),
        (["order=shuffle(1f1b,lifo,depth_first)"], ["order=shuffle(1f1b,depth_first)"], ["order=lifo"]),
        (["comm=range(0,3)"], ["comm=range(0,3)"], []),  # every value has the right type
        (["strategy=ddp,lpp", "G=1,2", "hydra.sweep.dir=x"], ["strategy=ddp,lpp", "G=1,2", "hydra.sweep.dir=x"], []),
    ],
)
def test_sweep_precheck_takes_out_only_the_invalid_values(overrides, kept, skipped):
    found = check_sweep_overrides(overrides)
    assert found.fatal == []
    assert found.overrides == kept
    assert [point for point, _ in found.skipped] == skipped
    for point, sentence in found.skipped:
        assert sentence.startswith(f"{point} is ") and "\n" not in sentence


@pytest.mark.parametrize(
    "overrides",
    [["strategy=foo,bar"], ["strategy=lpp,foo", "G=2.5"], ["colour=red,blue"], ["G=x,y", "R=1,2"]],
)
def test_sweep_precheck_is_fatal_when_nothing_valid_is_left(overrides):
    found = check_sweep_overrides(overrides)
    assert found.fatal == check_overrides(overrides) and found.fatal
    assert found.skipped == [] and found.overrides == overrides


def test_command_line_precheck_accepts_valid_overrides():
    assert check_overrides([
        "strategy=ddp,gpipe,lpp,fslpp,fsdp", "order=breadth_first", "G=1,2", "R=range(1,3)", "stages=8",
        "warmup=null", "memory_limit=[3,3]", "durations.F=2", "comm=0.5", "G=${microbatches}",
        "strategy=custom", "strategy.placement._target_=a.b", "+strategy.placement.G=2", "hydra.run.dir=x",
        "weight_cache=job", "split_backward=true", "seed=3",
    ]) == []


def test_to_step_matches_make_step(cfg_of):
    c = cfg_of("strategy=fslpp", "G=2", "R=2", "stages=4", "microbatches=6", "order=breadth_first", "comm=0.5")
    step = to_schedule(c)
    ref = make_schedule("fslpp", 4, 6, G=2, R=2, order="breadth_first", comm=0.5)
    assert (step.workers, step.S, step.microbatches, step.name, step.order.name) == (4, 4, 6, "fslpp", "breadth_first")
    a, b = simulate(step), simulate(ref)
    assert (a.start, a.finish, a.compute, a.owner) == (b.start, b.finish, b.compute, b.owner)


def test_lpp_identities_through_the_config(cfg_of):
    """LPP with G=1, R=S is GPipe; with G=B, R=1 it is DDP: the same timelines from the config."""
    for named, G, R in (("gpipe", 1, 4), ("ddp", 6, 1)):
        a = simulate(to_schedule(cfg_of(f"strategy={named}", "stages=4", "microbatches=6")))
        b = simulate(to_schedule(cfg_of("strategy=lpp", f"G={G}", f"R={R}", "stages=4", "microbatches=6")))
        assert (a.start, a.finish, a.compute) == (b.start, b.finish, b.compute)


def test_custom_placement_and_order_by_target(cfg_of):
    c = cfg_of(
        "strategy=custom", "strategy.placement._target_=launcher.schedule.placement.LPP",
        "strategy.placement._partial_=false", "+strategy.placement.G=${G}", "+strategy.placement.R=${R}",
        "order=custom", "order.n._target_=operator.add",  # n(s, b, d) fails: three arguments
    )
    assert errors(c) == []
    with pytest.raises(ConfigError, match=r"^order.n._target_=operator.add failed on job \(0, 0, F\): TypeError"):
        simulate_config(c)
    c = cfg_of(
        "strategy=custom", "strategy.placement._target_=launcher.schedule.placement.LPP",
        "strategy.placement._partial_=false", "+strategy.placement.G=${G}", "+strategy.placement.R=${R}",
    )
    tl, summary = simulate_config(c)
    ref = simulate(make_schedule("lpp", 8, 16, G=2, R=4, order="1f1b"))  # a custom placement's default order
    assert tl.finish == ref.finish and summary["latency"] == ref.latency


def test_custom_target_that_cannot_be_built(cfg_of):
    with pytest.raises(ConfigError) as e:
        to_schedule(cfg_of("strategy=custom", "strategy.placement._target_=no_such_module.fn"))
    assert e.value.sentences == [
        "strategy.placement._target_=no_such_module.fn could not be built: there is no module no_such_module in "
        f"the working directory ({os.getcwd()}) or on PYTHONPATH; run from the directory that holds "
        "no_such_module.py (or the package no_such_module/), or add that directory to PYTHONPATH."
    ]


def test_a_key_without_effect_under_the_scheme_warns_once_and_runs(cfg_of, caplog):
    """An order under DDP, a weight cache or a prefetch where nothing is fetched: valid, one
    warning line each, and the step is the one the scheme's defaults give."""
    from launcher.config import settings_of

    c = cfg_of("strategy=ddp", "order=breadth_first", "weight_cache=job", "prefetch=3", "stages=4", "microbatches=6")
    assert errors(c) == []
    with caplog.at_level("WARNING", logger="launcher"):
        tl = simulate(settings_of(c).schedule())
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "warning: order=breadth_first has no effect with strategy=ddp: each DDP worker takes its one micro-batch "
        "through every stage alone, with no pipeline bubble for an order to fill; the run goes on.",
        "warning: weight_cache=job has no effect with strategy=ddp: every ddp worker holds the weights of the stages "
        "it computes, so no weights are fetched and none are cached; the run goes on (it matters under fsdp, fslpp "
        "and custom placements).",
        "warning: prefetch=3 has no effect with strategy=ddp: its workers neither fetch weights nor receive "
        "activations, so there is nothing to look ahead for; the run goes on."]
    ref = simulate(make_schedule("ddp", 4, 6))
    assert (tl.start, tl.finish, tl.compute) == (ref.start, ref.finish, ref.compute)
    caplog.clear()
    with caplog.at_level("WARNING", logger="launcher"):
        settings_of(cfg_of("strategy=gpipe", "order=breadth_first", "prefetch=3"))  # each has an effect there
    assert caplog.records == []


def test_the_strategy_keywords_build_the_settings_the_command_line_does(cfg_of):
    """``UnifiedStrategy``'s keyword form and the command line arrive at the same :class:`Settings`;
    the strategy takes them as they are (``settings=``), checked once where they entered."""
    from launcher.config import settings_of
    from launcher.lightning import UnifiedStrategy

    cli = settings_of(cfg_of("strategy=fsdp", "stages=4", "microbatches=2", "weight_cache=job", "prefetch=2"))
    kw = UnifiedStrategy("fsdp", stages=4, microbatches=2, weight_cache="job", prefetch=2).settings
    assert kw == cli and (kw.G, kw.R) == (2, 1)
    assert UnifiedStrategy(settings=cli).settings is cli
    with pytest.raises(TypeError, match="either as settings"):
        UnifiedStrategy(settings=cli, stages=4)


def test_order_auto_composes_validates_and_searches_under_the_limit(cfg_of):
    from launcher.schedule.activations import unit_peaks

    c = cfg_of("order=auto", "memory_limit=8", "strategy=gpipe", "stages=4", "microbatches=8")
    assert (c.order.name, c.split_backward, c.memory_limit) == ("auto", True, 8)
    assert errors(c) == []
    step = to_schedule(c)
    assert step.order.seqs is not None
    tl = simulate(step)
    assert max(unit_peaks(tl)) <= 8
    assert errors(cfg_of("order=auto", "split_backward=false", "strategy=gpipe")) != []
