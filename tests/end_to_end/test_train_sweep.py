"""A training sweep: every point runs (an invalid one is recorded and skipped, a failing one is
recorded as failed with its error and log), one table of all points at the end, the exit code
says whether every point ran, and the runs of the sweep share one W&B group."""

from __future__ import annotations

import json

import pytest

from helpers.cli import run_launcher
from launcher.report.wandb_read import find_runs, read_run

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

BOOM = '''
from launcher.models import GPT


class MaybeBoom(GPT):
    """Fails in its first forward on a worker when d_model is 24."""

    def forward(self, idx):
        return super().forward(idx)

    def on_train_start(self):
        if self.hparams.d_model == 24:
            raise RuntimeError("d_model=24 is not supported by this model")
'''

SMALL = ["data.batch_size=8", "data.seq_len=8", "data.chars=20000", "+model.seq_len=8", "+model.n_head=2",
         "+model.n_layer=2", "microbatches=4", "trainer.max_steps=3", "trainer.val_check_interval=3"]


def test_sweep_records_every_point_and_shares_a_wandb_group(tmp_path):
    (tmp_path / "boom.py").write_text(BOOM)
    sweep = tmp_path / "sweep"
    p = run_launcher("-m", "strategy=fslpp", "G=2", "R=2", "model=custom", "model._target_=boom.MaybeBoom",
                     "+model.d_model=16,24,32", "stages=4,9", *SMALL, f"hydra.sweep.dir={sweep}", cwd=tmp_path,
                     pythonpath="cwd", columns=250, timeout=280)
    assert p.returncode == 1, p.stderr[-3000:]  # a point failed while training
    assert "sweep: 6 points" in p.stdout
    table = p.stdout[p.stdout.index("sweep: 6 points"):]
    assert table.count("│ ok ") + table.count(" ok ") >= 2
    assert table.count("invalid: stages=9 is invalid") == 3
    assert table.count("failed: rank") == 1
    assert "error: 3 of 6 points were invalid and skipped" in p.stderr
    assert "error: 1 of 6 points failed while training" in p.stderr

    outcomes = {d.name: sorted(f.name for f in d.glob("*.json")) for d in sweep.iterdir() if d.is_dir()}
    assert sorted(map(tuple, outcomes.values())) == sorted(
        [("metrics.json", "trace.json")] * 2 + [("invalid.json",)] * 3 + [("failed.json",)])
    failed = next(d for d in sweep.iterdir() if (d / "failed.json").exists())
    record = json.loads((failed / "failed.json").read_text())
    assert "RuntimeError: d_model=24 is not supported" in record["error"]
    assert record["log"] == str(failed / "launcher.log") and "d_model=24" in (failed / "launcher.log").read_text()

    runs = [read_run(f) for f in find_runs(sweep)]
    ok = [r for r in runs if any("train_loss" in h for h in r.history)]
    assert len(ok) == 2 and {r.group for r in ok} == {sweep.name}
