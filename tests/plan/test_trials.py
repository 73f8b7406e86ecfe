"""``plan.trials``: the planner's top candidates trained on real workers, the fastest measured kept."""

from __future__ import annotations

import json

import pytest

import launcher.config  # noqa: F401  (registers the schema)
from helpers.cli import SMALL_RUN, run_launcher
from launcher.config import errors
from launcher.modes.trials import Trial, fastest, run_trials, trial_overrides
from launcher.plan import Budget, search, unit

UNIT = {"F": 1.0, "B": 1.0, "I": 0.5, "W": 0.5}


def _candidates(k: int = 3):
    return search(2, [4], 2, unit(UNIT, 0.0), Budget(None, None), top=k).candidates[:k]


def test_a_trial_keeps_the_users_overrides_but_those_it_sets():
    user = ["mode=plan", "G=1", "R=2", "strategy=fslpp", "strategy.ownership=balanced", "plan.trials=3",
            "plan.profile=m.json", "data.seq_len=8", "+model.extra=1", "trainer.max_steps=100", "logger=wandb",
            "order=zb_h1", "order.name=zb_h1", "seed=3"]
    cand = ["strategy=lpp", "G=2", "R=1", "stages=2", "order=1f1b", "warmup=classic"]
    got = trial_overrides(user, cand, steps=4)
    # the user's data, model and seed stay; the mode, plan.*, the scheme and order groups (and keys
    # under them), the candidate's own keys, the logger and the steps are the trial's
    assert got[:3] == ["data.seq_len=8", "+model.extra=1", "seed=3"]
    assert got[3:3 + len(cand)] == cand
    assert got[3 + len(cand):] == ["mode=train", "logger=none", "trainer.enable_checkpointing=false",
                                   "trainer.limit_val_batches=0", "trainer.max_steps=4"]


def test_the_fastest_trial_is_chosen_and_a_failed_one_never():
    a, b, c = _candidates()
    trials = [Trial(1, a, [0.30, 0.32]), Trial(2, b, [0.20], error="exit 1: boom"), Trial(3, c, [0.25, 0.27, 0.40])]
    assert fastest(trials) is trials[2]  # a median of 0.27 beats 0.31; the failed one is out
    assert fastest([Trial(1, a, [0.2]), Trial(2, b, [0.2])]).rank == 1  # a tie keeps the predicted order
    assert fastest([Trial(1, a, error="x")]) is None
    assert trials[1].to_json()["median_s"] is None and trials[2].to_json()["median_s"] == 0.27


def test_a_trial_that_fails_is_reported_with_its_error(tmp_path):
    (cand,) = _candidates(1)
    # an invalid setting of the user's fails the trial's validation at once (no worker starts)
    trials = run_trials([cand], ["data.batch_size=0"], tmp_path / "trials", steps=2, rounds=2, cwd=tmp_path)
    assert trials[0].measured_s == [] and trials[0].median_s is None
    assert trials[0].error.startswith("exit ") and "data.batch_size=0 is invalid" in trials[0].error
    assert not (tmp_path / "trials" / "1-1").exists()  # not run again once it failed


def test_trial_keys_are_validated(cfg_of):
    assert errors(cfg_of(["mode=plan", "plan.trials=-1"])) == [
        "plan.trials=-1 is invalid: it must be 0 (choose by prediction) or a positive integer."]
    assert errors(cfg_of(["mode=plan", "plan.trials=2", "plan.trial_steps=1", "plan.trial_rounds=0"])) == [
        "plan.trial_steps=1 is invalid: it must be an integer of at least 2 (the first step warms up and is not "
        "measured).", "plan.trial_rounds=0 is invalid: it must be a positive integer."]
    assert errors(cfg_of(["mode=simulate", "strategy=auto", "plan.trials=2"]))[:1] == [
        "plan.trials=2 is invalid with mode=simulate: trials run under mode=plan only (strategy=auto takes the "
        "predicted best; train mode=plan's best by its overrides)."]
    assert errors(cfg_of(["mode=plan", "plan.trials=2"])) == []


@pytest.mark.slow
def test_plan_trials_train_the_top_candidates_and_keep_the_fastest(tmp_path):
    """``mode=plan plan.trials=2``: each of the top two trains on real workers with the user's own
    settings; ``best`` is the fastest measured and reproduces under ``mode=simulate``."""
    small = [o for o in SMALL_RUN if not o.startswith(("stages=", "microbatches="))]
    out = run_launcher("mode=plan", "G=1", "R=2", "stages=2", "microbatches=2", "plan.workers=2", *small,
                       "plan.trials=2", "plan.trial_steps=3", "plan.trial_rounds=1", f"hydra.run.dir={tmp_path / 'p'}",
                       cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    rec = json.loads((tmp_path / "p" / "plan.json").read_text())
    runs = rec["trials"]["runs"]
    assert [r["rank"] for r in runs] == [1, 2] and all(r["error"] is None and len(r["measured_s"]) == 1 for r in runs)
    won = min(runs, key=lambda r: (r["median_s"], r["rank"]))
    assert rec["best"]["overrides"] == won["overrides"] == rec["candidates"][won["rank"] - 1]["overrides"]
    for r in runs:  # each trial trained the candidate with the user's model and data
        m = json.loads((tmp_path / "p" / "trials" / f"{r['rank']}-0" / "metrics.json").read_text())
        assert m["config"]["model"]["d_model"] == 16 and m["config"]["data"]["seq_len"] == 8
        assert m["config"]["mode"] == "train" and m["latency_s"]["measured"] == r["median_s"]
        assert r["peak_activations"] == max(m["per_worker"]["peak_activations"]["measured"])
    assert "trials: the top 2 trained for 3 steps x 1 rounds" in out.stdout
