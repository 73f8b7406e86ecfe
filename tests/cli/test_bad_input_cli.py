"""The command line and the Python API: every bad input is one sentence naming the key,
the value and the rule (exit 2), before anything runs; huge steps are refused or bounded; the
console script finds the user's modules; a reused run directory keeps only its latest outcome.

Most inputs are checked through the validation functions the commands call (no process start);
a handful of real commands show the exit codes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest

import launcher.config  # noqa: F401  (registers the schema and the resolver)
from helpers.cli import launcher_env, run_launcher
from launcher.config import check_overrides, errors
from launcher.config.paths import dir_error, file_error
from launcher.modes.simulation import simulate_config
from launcher.schedule import ScheduleError, StepError, assembly, make_schedule, simulate
from launcher.schedule.diagram import ascii_diagram
from launcher.schedule.lowering import LoweringError, lower
from launcher.schedule.simulate import Schedule

SIZES = "the sizes G, R, stages and microbatches must be positive integers."
LAUNCHER = Path(sys.executable).with_name("launcher")  # the console script of this environment


#: the command in an environment without PYTHONPATH (``command=(str(LAUNCHER),)``: the console script)
run = partial(run_launcher, hydra_full_error="0", pythonpath="drop")


def run_with_peak(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess, int]:
    """`run`, and the peak resident bytes of that one process (RUSAGE_CHILDREN would give the
    largest of every child this test session has started)."""
    env = launcher_env(hydra_full_error="0", pythonpath="drop")
    cmd = [sys.executable, "-m", "launcher", *args]
    with open(cwd / "out.txt", "w+") as out, open(cwd / "err.txt", "w+") as err:
        child = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        done = subprocess.CompletedProcess(cmd, child.returncode, out.read(), err.read())
    return done, usage.ru_maxrss * 1024


# ---- the command line's values ------------------------------------------------------------------


@pytest.mark.parametrize("override, sentence", [
    ("durations.F=inf", "durations.F=inf is invalid: job durations must be positive finite numbers."),
    ("durations.B=nan", "durations.B=nan is invalid: job durations must be positive finite numbers."),
    ("comm=inf", "comm=inf is invalid: the communication delay must be a finite number >= 0."),
    ("comm=-inf", "comm=-inf is invalid: the communication delay must be a finite number >= 0."),
    ("+stagse=4", "stagse=4 is invalid: stagse is not a known key; did you mean stages?"),
    ("stagse=4", "stagse=4 is invalid: stagse is not a known key; did you mean stages?"),
    ("+durations.f=3", "durations.f=3 is invalid: durations.f is not a known key; did you mean durations.F?"),
    ("++microbatch=3", "microbatch=3 is invalid: microbatch is not a known key; did you mean microbatches?"),
    ("+strategy.nme=x", "strategy.nme=x is invalid: strategy.nme is not a known key; did you mean strategy.name?"),
    ("+zzz=1", "zzz=1 is invalid: zzz is not a known key."),
    ("hydra.run.dir=/proc/launcher-run", "hydra.run.dir=/proc/launcher-run is invalid: its existing parent /proc is "
                                         "not writable, so the run could not save its results."),
    ("G=2.5", f"G=2.5 is invalid: {SIZES}"),
    ("step_overlap=yes", "step_overlap=yes is invalid: use none (every step ends on every worker before the next "
                         "begins), post_validation (each stage steps as soon as its own gradients are final) or "
                         "post_validation_paper (priced only: the paper's speculative chain)."),
])
def test_a_bad_command_line_value_is_one_sentence(cfg_of, override, sentence):
    # what the command reports: the pre-check's sentences, else the composed config's
    assert (check_overrides([override]) or errors(cfg_of(override))) == [sentence]


def test_keys_added_under_a_custom_node_are_legitimate():
    assert check_overrides(["strategy=custom", "strategy.placement._target_=mymodule.my_placement",
                            "+strategy.placement.G=${G}", "+strategy.placement.R=${R}"]) == []


def test_output_paths(tmp_path):
    (tmp_path / "file").write_text("")
    assert dir_error("hydra.run.dir", tmp_path / "new" / "deeper") is None
    assert dir_error("hydra.run.dir", f"{tmp_path}/out/${{now:%H}}") is None
    assert dir_error("hydra.run.dir", tmp_path / "file" / "run") == (
        f"hydra.run.dir={tmp_path / 'file' / 'run'} is invalid: {tmp_path / 'file'} is a file, not a directory.")
    assert file_error("out", tmp_path) == f"out={tmp_path} is invalid: it is a directory; give a file name."
    assert file_error("out", "/proc/steps.json") == (
        "out=/proc/steps.json is invalid: its existing parent /proc is not writable, so the run could not save its "
        "results.")
    assert file_error("out", tmp_path / "steps.json") is None


# ---- the composed config and the Python API: one set of rules --------------------------------


def test_the_api_checks_what_the_command_line_checks(cfg_of):
    cases = [  # (make_schedule arguments, the same step on the command line, the sentence)
        (dict(G=0), ["G=0"], f"G=0 is invalid: {SIZES}"),
        (dict(stages=0), ["stages=0"], f"stages=0 is invalid: {SIZES}"),
        (dict(microbatches=-1), ["microbatches=-1"], f"microbatches=-1 is invalid: {SIZES}"),
        (dict(durations={"F": math.inf}), ["durations.F=inf"],
         "durations.F=inf is invalid: job durations must be positive finite numbers."),
        (dict(comm=math.nan), ["comm=nan"],
         "comm=nan is invalid: the communication delay must be a finite number >= 0."),
        (dict(memory_limit=[1, 2]), ["memory_limit=[1,2]"],
         "memory_limit=[1, 2] is invalid: it has 2 entries but there are W=8 workers (memory_limit must be null, a "
         "positive integer, or a list of positive integers, one per worker)."),
        (dict(strategy="ddp"), ["strategy=ddp", "G=2", "R=4"],
         "strategy=ddp needs W = microbatches, but W=G*R=8 and microbatches=16; set G=16 R=1 (the ddp layout) or "
         "microbatches=8."),
        (dict(stages=100000, microbatches=100000, G=1, R=1), ["stages=100000", "microbatches=100000", "G=1", "R=1"],
         "stages*microbatches=100000*100000=10000000000 is too large: the step would have 20,000,000,000 jobs "
         "(about 20,000 GB to plan) and the limit is 8,388,608 jobs."),
    ]
    base = dict(strategy="lpp", stages=8, microbatches=16, G=2, R=4)
    for kw, overrides, sentence in cases:
        with pytest.raises(StepError) as e:
            make_schedule(**{**base, **kw})
        assert e.value.sentences == [sentence]
        assert (check_overrides(overrides) or errors(cfg_of(*overrides))) == [sentence]
    # the API's own spelling of a key: a job kind that does not exist is refused, not ignored
    with pytest.raises(StepError, match=r"^durations.f=3 is invalid: durations.f is not a known key; did you mean "
                                        r"durations.F\?$"):
        make_schedule("lpp", 8, 16, G=2, R=4, durations={"f": 3})
    assert errors(cfg_of("png=maybe")) == ["png=maybe is invalid: use true, false or auto."]


def test_a_step_that_does_not_finish_is_not_blamed_on_memory():
    step = make_schedule("gpipe", 2, 2, G=1, R=2)
    step.durations = {**step.durations, "B": math.inf}  # built by hand, past make_schedule's checks
    with pytest.raises(StepError, match=r"^durations.B=inf is invalid: job durations must be positive finite"):
        simulate(step)
    with pytest.raises(ScheduleError, match=r"^memory_limit=1 on worker 0 cannot finish the step"):
        simulate(make_schedule("lpp", 2, 2, G=1, R=1, memory_limit=1))
    assert isinstance(step, Schedule)


def test_simulate_reports_the_runtimes_resident_weights_for_its_prefetch(cfg_of):
    for prefetch, peaks in ((7, [2, 8, 2, 8, 8, 2, 8, 2]), (0, None)):
        cfg = cfg_of("strategy=fslpp", "weight_cache=job", f"prefetch={prefetch}")
        tl, summary = simulate_config(cfg)
        want = lower(tl, "job", prefetch).predicted["weights_peak_resident"]
        assert summary["per_worker"]["weights_peak_resident"] == want
        assert summary["total"]["weights_peak_resident"] == sum(want)
        if peaks:
            assert want == peaks


def test_message_tags_are_checked_against_their_range(monkeypatch):
    tl = simulate(make_schedule("gpipe", 4, 4, G=1, R=4))
    plan = lower(tl)
    assert plan.tag_base == len(plan.messages)
    monkeypatch.setattr(assembly, "TAG_LIMIT", len(plan.messages))
    with pytest.raises(LoweringError,
                       match=r"^the step has \d+ messages and 4 stages, more than the \d+ point-to-point"):
        lower(tl)


def test_the_text_diagram_of_a_huge_step_is_a_note_at_no_cost():
    # at lpp's default order, interleaved_1f1b (1f1b: 2122 slots)
    tl = simulate(make_schedule("lpp", 64, 1024, G=8, R=8))
    t0 = time.perf_counter()
    assert ascii_diagram(tl) == "(diagram omitted: 2062 time slots > 240)"
    assert time.perf_counter() - t0 < 0.1


# ---- the commands a user types ------------------------------------------------------------------


def test_bad_values_exit_2_with_one_sentence_each(tmp_path):
    p = run("mode=simulate", "durations.F=inf", "comm=inf", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.splitlines() == [
        "error: durations.F=inf is invalid: job durations must be positive finite numbers.",
        "error: comm=inf is invalid: the communication delay must be a finite number >= 0.",
    ]
    p = run("+stagse=4", cwd=tmp_path)  # found before Hydra starts
    assert p.returncode == 2 and p.stderr.splitlines() == [
        "error: stagse=4 is invalid: stagse is not a known key; did you mean stages?"]
    t0 = time.monotonic()
    p = run("mode=simulate", "stages=100000", "microbatches=100000", cwd=tmp_path)
    assert p.returncode == 2 and time.monotonic() - t0 < 30
    assert p.stderr.startswith("error: stages*microbatches=100000*100000=10000000000 is too large")
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("simulation.json"))


def test_console_script_imports_from_the_working_directory_and_a_run_dir_keeps_only_its_outcome(tmp_path):
    if not LAUNCHER.exists():
        pytest.skip("the launcher console script is not installed in this environment")
    (tmp_path / "mymodule.py").write_text(
        "def my_placement(s, b, d, G, R):\n    w = R * (b % G) + (s % R)\n    return (w, w)\n")
    run_dir = tmp_path / "run"
    p = run("mode=simulate", "strategy=custom", "strategy.placement._target_=mymodule.nope", f"hydra.run.dir={run_dir}",
            cwd=tmp_path, command=(str(LAUNCHER),))
    assert p.returncode == 2
    assert p.stderr.splitlines() == [
        "error: strategy.placement._target_=mymodule.nope could not be built: module mymodule has no attribute nope."]
    assert (run_dir / "invalid.json").exists()
    p = run("mode=simulate", "strategy=custom", "strategy.placement._target_=mymodule.my_placement",
            "+strategy.placement.G=${G}", "+strategy.placement.R=${R}", "stages=4", "microbatches=4", "png=false",
            f"hydra.run.dir={run_dir}", cwd=tmp_path, command=(str(LAUNCHER),))
    assert p.returncode == 0, p.stderr
    assert not (run_dir / "invalid.json").exists()  # the stale verdict of the last run is gone
    assert json.loads((run_dir / "simulation.json").read_text())["workers"] == 8
    assert "pipeline.png skipped: png=false" in p.stdout


def test_a_large_step_shows_progress_and_skips_the_picture_in_bounded_time_and_memory(tmp_path):
    t0 = time.monotonic()
    p, peak = run_with_peak("mode=simulate", "stages=64", "microbatches=2048", "G=8", "R=8",
                            f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    took = time.monotonic() - t0
    assert p.returncode == 0, p.stderr
    assert "simulating (262,144 jobs) ..." in p.stderr.splitlines()
    assert "(pipeline.png skipped: 262,144 jobs > 10,000; png=true draws it anyway)" in p.stdout
    assert "(diagram omitted:" in p.stdout and not (tmp_path / "run" / "pipeline.png").exists()
    assert took < 40, took  # 21 s before, 20 of them drawing the PNG; about 5 s now
    assert peak < 1.5e9, peak
