"""``python -m launcher`` trains (mode=train, the default): metrics.json, the W&B offline run read
back from disk, checkpoints that resume exactly, load on one process and resume under another
scheme."""

from __future__ import annotations

import json
import subprocess
from functools import partial
from pathlib import Path

import pytest
import torch

from helpers.cli import SMALL_RUN, run_launcher
from helpers.training import last_state
from launcher.report.wandb_read import find_runs, read_run

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

#: a small model and data, so each run takes seconds
SMALL = SMALL_RUN


launcher = partial(run_launcher, timeout=240, pythonpath="cwd")


@pytest.fixture(scope="module")
def fslpp_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("train")
    run = tmp / "run"
    p = launcher("strategy=fslpp", "G=2", "R=2", *SMALL, "trainer.max_steps=4", "trainer.val_check_interval=2",
                 f"hydra.run.dir={run}", cwd=tmp)
    return run, p


def test_trains_and_prints_the_summary(fslpp_run):
    run, p = fslpp_run
    assert p.returncode == 0, p.stderr[-3000:]
    assert "train fslpp G=2 R=2 W=4 stages=4 microbatches=4 order=interleaved_1f1b: 4 steps" in p.stdout  # its default
    for row in ("step time (ms)", "throughput (samples/s)", "bubble fraction", "per worker"):
        assert row in p.stdout
    assert f"wrote {run / 'metrics.json'}" in p.stdout.replace("\n", "")
    # what every run shows: a bar of steps (not Lightning's "Epoch 0/-2" of max_epochs=-1), no -0.000,
    # no W&B warning about the "anonymous" setting Lightning passes on
    assert "Epoch 0/-" not in p.stdout and "Step " in p.stdout and " 4/4 " in p.stdout, p.stdout[:500]
    assert "-0.000" not in p.stdout
    assert "anonymous" not in p.stderr, p.stderr[-3000:]


def test_metrics_json(fslpp_run):
    run, _ = fslpp_run
    m = json.loads((run / "metrics.json").read_text())
    assert m["run"] | {"scheme": "fslpp", "G": 2, "R": 2, "W": 4} == m["run"]
    assert [s["step"] for s in m["steps"]] == [1, 2, 3, 4]
    assert all(s["loss"] > 0 and s["step_s"] > 0 and s["samples_per_s"] > 0 for s in m["steps"])
    assert m["steps"][-1]["loss"] < m["steps"][0]["loss"]
    assert [v["step"] for v in m["val"]] == [2, 4]
    for key in ("latency_s", "throughput_samples_per_s", "bubble_fraction"):
        assert m[key]["predicted"] > 0 and m[key]["measured"] > 0
    # what a step would cost under post-validation's chain (issue 49): a prediction only, from the
    # same programs and measured times; the chain's W - 1 hops can cost more than the barrier's one
    # all-reduce (exact prices: tests/schedule/test_overlap.py), but not a second step
    cost = m["step_cost_s"]
    assert cost["step_overlap"] == "none" and cost["predicted"] == m["latency_s"]["predicted"]
    assert 0 < cost["predicted_post_validation"] < cost["predicted"] * 2
    pw = m["per_worker"]
    for key in ("peak_activations", "weights_owned", "weights_peak_resident"):
        assert pw[key]["predicted"] == pw[key]["measured"], key
    for kind in ("act", "grad", "weights", "wgrad"):
        assert pw["traffic_count"][kind]["predicted"] == pw["traffic_count"][kind]["measured"], kind
        assert pw["traffic_bytes"][kind]["predicted"] == pw["traffic_bytes"][kind]["measured"], kind
    assert pw["peak_activation_bytes"]["predicted"] == pw["peak_activation_bytes"]["measured"]
    assert len(pw["peak_memory_bytes"]["measured"]) == 4 and min(pw["peak_memory_bytes"]["measured"]) > 2**20
    assert m["profile"]["durations_s"]["F"] > 0 and len(m["profile"]["bytes"]["params"]) == 4
    # the link workers 0 and 1 measured prices every message of the prediction
    link = m["profile"]["link"]
    assert link["latency_s"] > 0 and link["bytes_per_s"] > 0 and m["profile"]["comm_s"] > link["latency_s"]
    # CPU workers on one host, transport=auto: replicas would reduce through shared memory, and the
    # planner reading this profile prices them so (fslpp here has none: said all the same)
    assert m["profile"]["shared_reduce"] is True
    assert (run / "pipeline.png").stat().st_size > 1000
    assert (run / "checkpoints" / "last.ckpt").exists()


def test_wandb_offline_run_read_back(fslpp_run):
    run, _ = fslpp_run
    files = find_runs(run)
    assert len(files) == 1 and str(run / "wandb") in files[0]
    r = read_run(files[0])
    assert r.group == "run"  # a single run is its own group; a sweep's runs share the sweep's
    assert r.tags == ["fslpp", "G=2", "R=2", "interleaved_1f1b"]
    assert r.config["strategy"]["name"] == "fslpp" and r.config["G"] == 2
    losses = [h["train_loss"] for h in r.history if "train_loss" in h]
    m = json.loads((run / "metrics.json").read_text())
    assert losses == pytest.approx([s["loss"] for s in m["steps"]])
    assert any("step_s" in h for h in r.history) and any("val_loss" in h for h in r.history)
    assert r.summary["latency_s/predicted"] == pytest.approx(m["latency_s"]["predicted"])
    assert r.summary["latency_s/measured"] == pytest.approx(m["latency_s"]["measured"])
    assert r.summary["pipeline/_type"] == "image-file"
    assert r.summary["per_worker/_type"] == "table-file"
    image = Path(r.dir) / "files" / r.summary["pipeline/path"]
    assert image.exists() and image.read_bytes()[:4] == b"\x89PNG"
    table = json.loads((Path(r.dir) / "files" / r.summary["per_worker/path"]).read_text())
    assert table["columns"] == ["worker", "metric", "predicted", "measured"] and len(table["data"]) > 4


RESUME = [*SMALL, "model.max_steps=6", "trainer.precision=64-true", "trainer.val_check_interval=3", "logger=none"]


def test_resume_equals_uninterrupted_and_across_schemes(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for d, steps, extra in ((a, 6, []), (b, 3, ["png=false"])):
        p = launcher("strategy=fslpp", "G=2", "R=2", *RESUME, f"trainer.max_steps={steps}", f"hydra.run.dir={d}",
                     *extra, cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-3000:]
    # png=false leaves the diagram out of a training run too (the picture changes nothing resumed)
    assert (a / "pipeline.png").exists() and not (b / "pipeline.png").exists()
    assert json.loads((b / "metrics.json").read_text())["diagram"] is None
    ckpt = b / "checkpoints" / "last.ckpt"
    p = launcher("strategy=fslpp", "G=2", "R=2", *RESUME, "trainer.max_steps=6", f"ckpt_path={ckpt}",
                 f"hydra.run.dir={c}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    # a new run directory is what resuming into another run means: no warning from each worker about it
    assert "dirpath has changed" not in p.stderr, p.stderr[-3000:]
    assert " 6/6 " in p.stdout and "Epoch" not in p.stdout, p.stdout[:500]  # the run's steps, not 6/3
    want, got = last_state(a), last_state(c)
    assert want.keys() == got.keys()
    assert max((want[k] - got[k]).abs().max().item() for k in want) == 0.0

    # the same checkpoint resumes under another scheme and under Lightning's default strategy,
    # to the same parameters (float64, up to rounding)
    for strategy in (["strategy=gpipe"], ["strategy=single"]):
        d = tmp_path / strategy[0].split("=")[1]
        p = launcher(*strategy, *RESUME, "trainer.max_steps=6", f"ckpt_path={ckpt}", f"hydra.run.dir={d}", cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-3000:]
        assert "dirpath has changed" not in p.stderr, (strategy, p.stderr[-3000:])
        other = last_state(d)
        assert max((want[k] - other[k]).abs().max().item() for k in want) < 1e-10, strategy

    # and loads into the same LightningModule on one process (whose parameters are float32); fslpp's
    # checkpoint is sharded (a directory), read through the documented one-line call
    from launcher.checkpoint import as_file
    from launcher.models import GPT

    model = GPT.load_from_checkpoint(as_file(a / "checkpoints" / "last.ckpt"))
    assert model.state_dict().keys() == want.keys()
    assert all(torch.allclose(model.state_dict()[k].double(), want[k], rtol=1e-6, atol=1e-7) for k in want)
