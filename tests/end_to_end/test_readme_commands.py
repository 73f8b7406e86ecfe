"""End-to-end: the README's commands as subprocesses (``python -m launcher ...``)."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest

from helpers.cli import run_launcher

ROOT = Path(__file__).resolve().parents[2]
PER_WORKER = ("busy", "act_recv", "grad_recv", "weight_fetch_stages", "weight_fetch_jobs", "peak_activations",
              "weights_owned", "weights_peak_resident")


launcher = partial(run_launcher, hydra_full_error="0")


def test_simulate_prints_tables_and_diagram_and_writes_png_and_json(tmp_path):
    run_dir = tmp_path / "run"
    p = launcher("mode=simulate", "strategy=lpp", "G=2", "R=4", "stages=8", "microbatches=16", "order=1f1b",
                 f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    # the per-worker table with a total row, and the closed-form table
    assert "per worker" in out and "peak resident" in out and "│  total │" in out
    assert "simulated vs closed form" in out and "seed 000" in out and "seed 001" in out
    assert "latency_fb" in out and "differs" in out
    # the text diagram: one row per worker, cells f<stage>:<micro-batch>
    rows = [line for line in out.splitlines() if line.startswith(("w0 ", "w7 "))]
    assert len(rows) == 2 and "f0:0" in rows[0] and "b0:14" in rows[0] and "f3:1" in rows[1]

    rec = json.loads((run_dir / "simulation.json").read_text())
    assert rec["config"]["strategy"]["name"] == "lpp" and rec["config"]["W"] == 8
    assert rec["latency"] == 42.0 and rec["workers"] == 8
    assert rec["utilization"] == pytest.approx(256 / (8 * 42))
    assert rec["bubble_fraction"] == pytest.approx(1 - rec["utilization"])
    assert rec["rho"] == pytest.approx(rec["utilization"])  # F = B
    for k in PER_WORKER:
        assert len(rec["per_worker"][k]) == 8, k
    assert sum(rec["per_worker"]["busy"]) == 256
    assert rec["closed_form"]["000"]["latency_fb"] == 15.0 and rec["closed_form"]["001"]["latency_fb"] == 19.0
    assert rec["simulated"]["latency_fb"] == 21.0
    assert (run_dir / "pipeline.png").read_bytes()[:4] == b"\x89PNG"
    assert f"wrote {run_dir / 'simulation.json'}" in out


def test_invalid_config_is_one_sentence_and_exit_2(tmp_path):
    p = launcher("strategy=ddp", "G=2", "R=4", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.splitlines() == [
        "error: strategy=ddp needs W = microbatches, but W=G*R=8 and microbatches=16; set G=16 R=1 (the ddp "
        "layout) or microbatches=8."
    ]
    p = launcher("strategy=foo", cwd=tmp_path)  # rejected before Hydra starts
    assert p.returncode == 2
    assert p.stderr.splitlines() == [
        "error: strategy=foo is not a known strategy; choose one of ddp, fsdp, fslpp, gpipe, lpp, vshape, or a "
        "placement callable (strategy=custom with strategy.placement._target_); the launcher also takes strategy=auto "
        "(the planner chooses) and strategy=single (Lightning's default strategy on one device)."]
    # in a sweep, a typo in a plain override, or in every value of a sweep, stops it before any point runs
    for bad in (["strategy=ddp,lpp", "G=2.5"], ["strategy=foo,bar"]):
        p = launcher("-m", "mode=simulate", *bad, f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
        assert p.returncode == 2 and not (tmp_path / "sweep").exists()
        assert p.stderr.splitlines() == {
            "G=2.5": ["error: G=2.5 is invalid: the sizes G, R, stages and microbatches must be positive integers."],
            "strategy=foo,bar": [
                f"error: strategy={s} is not a known strategy; choose one of ddp, fsdp, fslpp, gpipe, lpp, vshape, "
                f"or a placement callable (strategy=custom with strategy.placement._target_); the launcher also takes "
                f"strategy=auto "
                f"(the planner chooses) and strategy=single (Lightning's default strategy on one device)."
                for s in ("foo", "bar")],
        }[bad[-1]]


def test_multirun_skips_an_invalid_sweep_value_and_runs_the_others(tmp_path):
    sweep = tmp_path / "sweep"
    p = launcher("-m", "mode=simulate", "strategy=lpp,foo", "stages=8", "microbatches=8", f"hydra.sweep.dir={sweep}",
                 cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == [
        "error: strategy=foo is not a known strategy; choose one of ddp, fsdp, fslpp, gpipe, lpp, vshape, or a "
        "placement callable (strategy=custom with strategy.placement._target_); the launcher also takes strategy=auto "
        "(the planner chooses) and strategy=single (Lightning's default strategy on one device).",
        "skipped: strategy=foo (invalid config; the other points still run)",
        "error: 1 invalid sweep value was skipped before the sweep started: strategy=foo",
    ]
    rec = json.loads((sweep / "0" / "simulation.json").read_text())
    assert rec["config"]["strategy"]["name"] == "lpp" and rec["config"]["stages"] == 8
    assert not (sweep / "1").exists()
    assert "Traceback" not in p.stderr


def test_multirun_skips_the_invalid_point_and_runs_the_others(tmp_path):
    sweep = tmp_path / "sweep"
    # ddp needs W = microbatches = 16: with G=2 R=4 that point is invalid; gpipe (W = stages = 8) and lpp run
    p = launcher("-m", "mode=simulate", "strategy=ddp,gpipe,lpp", "G=2", "R=4", "stages=8", "microbatches=16",
                 f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert "error: strategy=ddp needs W = microbatches" in p.stderr
    assert "skipped: mode=simulate strategy=ddp G=2 R=4 stages=8 microbatches=16" in p.stderr
    assert "1 of 3 points were invalid and skipped" in p.stderr
    invalid = json.loads((sweep / "0" / "invalid.json").read_text())
    assert invalid["errors"][0].startswith("strategy=ddp needs W = microbatches")
    assert not (sweep / "0" / "simulation.json").exists()
    for n, name in ((1, "gpipe"), (2, "lpp")):
        rec = json.loads((sweep / str(n) / "simulation.json").read_text())
        assert rec["config"]["strategy"]["name"] == name
        assert (sweep / str(n) / "pipeline.png").exists()
    assert "sweep: 3 points" in p.stdout and "skipped: invalid" in p.stdout


@pytest.mark.slow
def test_multirun_runs_a_point_whose_order_has_no_effect(tmp_path):
    """``-m strategy=ddp,gpipe order=breadth_first``: DDP has no order to choose, so its point says
    so in one warning line and runs, beside GPipe's."""
    sweep = tmp_path / "sweep"
    p = launcher("-m", "mode=simulate", "strategy=ddp,gpipe", "order=breadth_first", "stages=4", "microbatches=4",
                 "png=false", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    warned = [line for line in p.stderr.splitlines() if line.startswith("warning:")]
    assert warned == ["warning: order=breadth_first has no effect with strategy=ddp: each DDP worker takes its one "
                      "micro-batch through every stage alone, with no pipeline bubble for an order to fill; the run "
                      "goes on."]
    for n, name in ((0, "ddp"), (1, "gpipe")):
        rec = json.loads((sweep / str(n) / "simulation.json").read_text())
        assert rec["config"]["strategy"]["name"] == name and rec["config"]["order"]["name"] == "breadth_first"
    assert "sweep: 2 points" in p.stdout


def test_recipe_all_schemes(tmp_path):
    sweep = tmp_path / "all"
    p = launcher("--config-dir", str(ROOT / "recipes"), "-cn", "all_schemes", "stages=4", "microbatches=4",
                 f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    names = [json.loads((sweep / str(n) / "simulation.json").read_text())["config"]["strategy"]["name"]
             for n in range(5)]
    assert names == ["ddp", "fsdp", "gpipe", "lpp", "fslpp"]
    assert "sweep: 5 points" in p.stdout


def test_recipe_seed_lpp_bound_reaches_m_over_s_plus_1(tmp_path):
    """Seed 000's claim: LPP with G = B/2, R = 2S/M (breadth-first, memory limit M) reaches
    rho = M/(S+1); the recipe sweeps M = 8, 4, 2."""
    sweep = tmp_path / "sweep"
    p = launcher("--config-dir", str(ROOT / "recipes"), "-cn", "seed_lpp_bound", f"hydra.sweep.dir={sweep}",
                 "png=false", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    for n, R in enumerate((2, 4, 8)):
        rec = json.loads((sweep / str(n) / "simulation.json").read_text())
        M, S = 2 * 8 // R, 8
        assert rec["config"]["memory_limit"] == M and rec["rho"] == pytest.approx(M / (S + 1))


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml")))
def test_every_recipe_composes(recipe, tmp_path):
    """Each recipe docs/sweeps.md lists is a valid config (the Slurm one included: composing it submits nothing)."""
    p = launcher("--config-dir", str(ROOT / "recipes"), "-cn", recipe, "--cfg", "all", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "mode:" in p.stdout and "sweeper:" in p.stdout
    assert recipe in (ROOT / "docs" / "sweeps.md").read_text()
