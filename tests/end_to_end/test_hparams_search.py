"""Hyperparameter search with Hydra's Optuna sweeper, end to end as the command runs it: each trial
returns its optimized_metric, an invalid trial is reported to Optuna as failed and the study goes
on, the best trial (or the Pareto front) is printed with a command that reproduces it, a study in
which no trial completed ends in one sentence, and a bad optimized_metric is refused before any
trial runs."""

from __future__ import annotations

import json
import shlex
from functools import partial

import pytest
import yaml

from helpers.cli import run_launcher

pytestmark = pytest.mark.timeout(240)

#: two workers (GPipe over two stages), a tiny model and data, two steps with a validation at the end
SMALL = ["strategy=gpipe", "stages=2", "data.batch_size=8", "data.seq_len=8", "data.chars=20000", "model.d_model=16",
         "model.n_head=2", "model.n_layer=2", "trainer.max_steps=2", "trainer.val_check_interval=2", "logger=none"]


launcher = partial(run_launcher, timeout=200, columns=250)


@pytest.mark.slow
def test_a_study_goes_on_past_an_invalid_trial_and_prints_its_best_trial(tmp_path):
    sweep = tmp_path / "study"
    # no -m: hparams_search=optuna sets hydra.mode: MULTIRUN. Its seeded TPE sampler draws
    # microbatches 3, 3, 4 from choice(3,4): 3 does not divide data.batch_size=8, so trials 0 and 1
    # are invalid and trial 2 trains
    p = launcher("hparams_search=optuna", "hydra.sweeper.n_trials=3", "microbatches=choice(3,4)", *SMALL,
                 f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert "Traceback" not in p.stderr and "float-castable" not in p.stdout + p.stderr, p.stderr[-3000:]
    assert p.returncode == 2, p.stderr[-3000:]  # invalid trials: a sweep's exit code
    assert "Failed experiment: invalid config: data.batch_size=8 is invalid" in p.stdout
    assert "error: 2 of 3 trials were invalid and skipped (reported to Optuna as failed trials)" in p.stderr
    assert "study: 3 trials, 1 completed, 2 failed (2 invalid); optimized: val_loss (minimize)" in p.stdout
    out = p.stdout[p.stdout.index("best trial: "):].splitlines()
    trial = sweep / "2"
    metrics = json.loads((trial / "metrics.json").read_text())
    assert out[0] == f"best trial: #2 val_loss={metrics['val'][-1]['val_loss']:.6g}"
    assert out[1].strip().startswith("params: model.lr=") and out[1].strip().endswith(" microbatches=4")
    assert out[2].strip() == "run: study/2"  # from the working directory
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())  # the sweeper's own record
    assert results["best_params"]["microbatches"] == 4
    assert results["best_value"] == pytest.approx(metrics["val"][-1]["val_loss"])

    # the command reproduces the trial: its overrides, plus hydra.mode=RUN, so it runs once
    assert out[3].strip().startswith("reproduce: python -m launcher ")
    args = shlex.split(out[3].strip()[len("reproduce: "):])[3:]
    overrides = yaml.safe_load((trial / ".hydra" / "overrides.yaml").read_text())
    assert args == [*overrides, "hydra.mode=RUN"] and "hparams_search=optuna" in args
    assert not any(line.strip().startswith("note:") for line in out[:5])  # the check it ran found no difference
    from hydra.types import RunMode
    from omegaconf import OmegaConf, open_dict

    from launcher.config.compose import compose as _compose

    cfg = _compose("config", args, [])
    assert cfg.hydra.mode == RunMode.RUN
    with open_dict(cfg):
        del cfg["hydra"]
    assert OmegaConf.to_container(cfg) == yaml.safe_load((trial / ".hydra" / "config.yaml").read_text())


@pytest.mark.parametrize("argv", [
    ["hparams_search=optuna", "model.lr=interval(0.001,0.01)", "microbatches=range(2,5)",
     "model.d_model=choice(16,32)"],
    ["-m", "hydra/sweeper=optuna", "model.lr=tag(log,interval(0.001,0.01))", "microbatches=choice(2,4)", "G=1"],
])
def test_optunas_sweep_syntax_passes_the_command_line_check(argv):
    from launcher.preflight import preflight as _preflight

    new, found = _preflight(argv)
    assert (new, found.fatal, found.skipped) == (argv, [], [])


@pytest.mark.slow
def test_a_multi_objective_search_prints_its_pareto_front(tmp_path):
    sweep = tmp_path / "study"
    p = launcher("-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "model.lr=interval(0.001,0.01)",
                 "microbatches=4", "optimized_metric=[val_loss,step_s]", "hydra.sweeper.direction=[minimize,minimize]",
                 *SMALL, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "study: 2 trials, 2 completed, 0 failed; optimized: val_loss (minimize), step_s (minimize)" in p.stdout
    front = yaml.safe_load((sweep / "optimization_results.yaml").read_text())["solutions"]
    assert f"Pareto front: {len(front)} of 2 completed trials" in p.stdout
    for s in front:
        lr = f"model.lr={s['params']['model.lr']}"  # as the sweeper wrote the trial's override
        i = next(d.name for d in sweep.iterdir()
                 if d.name.isdigit() and yaml.safe_load((d / ".hydra" / "overrides.yaml").read_text())[0] == lr)
        metrics = json.loads((sweep / i / "metrics.json").read_text())
        assert s["values"] == pytest.approx([metrics["val"][-1]["val_loss"], metrics["latency_s"]["measured"]])
        assert f"#{i} val_loss={s['values'][0]:.6g} step_s={s['values'][1]:.6g}" in p.stdout
    assert p.stdout.count("reproduce: python -m launcher model.lr=") == len(front)
    assert "hydra.mode=RUN" not in p.stdout  # a -m search: its trials' overrides already run once


@pytest.mark.slow
def test_a_study_in_which_every_trial_fails_ends_in_one_sentence(tmp_path):
    p = launcher("hparams_search=optuna", "hydra.sweeper.n_trials=2", *SMALL, "microbatches=3",
                 f"hydra.sweep.dir={tmp_path / 'study'}", cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]  # every trial was invalid
    assert "error: all 2 trials failed (2 invalid): Optuna has no best trial; each trial's error is above." in p.stderr
    assert "Traceback" not in p.stderr and "No trials are completed yet" not in p.stdout + p.stderr
    assert "best trial" not in p.stdout


@pytest.mark.parametrize("args, sentence", [
    (["-m", "hydra/sweeper=optuna", "optimized_metric=val_los"],
     "error: optimized_metric=val_los is invalid: a run does not report val_los (did you mean val_loss?); use one of "
     "val_loss, train_loss, step_s, samples_per_s, peak_memory, bubble_fraction, or a key of metrics.json's summary"),
    (["hparams_search=optuna", "optimized_metric=[val_loss,step_s]"],
     "error: optimized_metric=[val_loss, step_s] is invalid with hydra.sweeper.direction=minimize: the search needs "
     "one direction per metric (2 metrics, 1 direction), e.g. hydra.sweeper.direction=[minimize,minimize]."),
    (["-m", "hydra/sweeper=optuna", "model.lr=interval(0.001,0.01)", "trainer.max_steps=3"],
     "error: optimized_metric=val_loss is invalid with trainer.max_steps=3 and trainer.val_check_interval=20: no "
     "validation runs before training ends, so no trial would have a val_loss; set trainer.val_check_interval to at "
     "most 3, or optimize train_loss."),
    (["hparams_search=optuna", "hydra.sweeper.params.microbatch='choice(2,4)'"],
     "error: hydra.sweeper.params: microbatch=choice(2,4) is invalid: microbatch is not a known key; did you mean "
     "microbatches?"),
    (["optimized_metric=5"], "error: optimized_metric=5 is invalid: it must name the metric the sweeper optimizes"),
])
def test_a_bad_search_is_refused_before_any_trial(tmp_path, args, sentence):
    p = launcher(*args, f"hydra.sweep.dir={tmp_path / 'study'}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    assert sentence in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "study").exists() and not (tmp_path / "run").exists()
