"""A NaN or an infinity in a training step is caught before the optimizer step.

``nonfinite=stop`` (the default) stops the run with one sentence naming the step, the micro-batch
and the stage where the first non-finite value appeared (the same under every scheme), exit 1,
and every checkpoint on disk stays finite (``last.ckpt`` the last finite one). ``nonfinite=skip``
drops the step, as a GradScaler does: no parameter moves, the run goes on, and ``metrics.json``
counts the skipped steps. ``data.seq_len=0`` (a loss that is nan from the first step) is refused
before any worker starts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from helpers.cli import finished, start_launcher, survivors
from helpers.training import load_checkpoint
from launcher.preflight import preflight as _preflight

pytestmark = pytest.mark.timeout(300)

NAN_MODEL = '''
import torch
from torch import nn

from launcher.models import GPT


class _NanGrad(nn.Module):
    """Wraps a stage: the same forward; from training step ``at`` on, its input's gradient is NaN."""

    def __init__(self, inner, owner, at):
        super().__init__()
        self.inner, self.at = inner, at
        self.__dict__["owner"] = owner  # a reference, not a submodule

    def forward(self, x):
        t = self.owner._trainer
        if t is not None and torch.is_grad_enabled() and not x.is_meta and t.global_step + 1 >= self.at:
            x = x + 0 * torch.sqrt(x - x.detach())  # forward: x; backward: 0 * inf = nan
        return self.inner(x)


class NanGPT(GPT):
    """The built-in GPT whose loss is NaN in training step ``at`` (where=loss), or whose stage
    ``stage`` gets a NaN input gradient from step ``at`` on (where=grad)."""

    def __init__(self, at: int = 3, where: str = "loss", stage: int = 2, **kw):
        super().__init__(**kw)
        self.at, self.where = at, where
        if where == "grad":
            self.stages[stage] = _NanGrad(self.stages[stage], self, at)

    def loss(self, logits, target):
        loss = super().loss(logits, target)
        t = self._trainer
        if self.where == "loss" and t is not None and torch.is_grad_enabled() and t.global_step + 1 == self.at:
            loss = loss * float("nan")
        return loss
'''

#: 4 stages (embedding, 2 blocks, head), 4 micro-batches; a checkpoint every 2 steps
SMALL = ["model=custom", "model._target_=nanmodel.NanGPT", "+model.seq_len=8", "+model.d_model=16", "+model.n_head=2",
         "+model.n_layer=2", "stages=4", "microbatches=4", "data.batch_size=8", "data.seq_len=8", "data.chars=20000",
         "logger=none", "trainer.limit_val_batches=1", "trainer.val_check_interval=2"]


def launcher(*args: str, cwd: Path) -> subprocess.Popen:
    (cwd / "nanmodel.py").write_text(NAN_MODEL)
    return start_launcher(*args, cwd=cwd, pythonpath="cwd")


def all_finite(ckpt: dict) -> bool:
    tensors = list(ckpt["state_dict"].values())
    tensors += [v for st in ckpt["optimizer_states"] for s in st["state"].values() for v in s.values()
                if torch.is_tensor(v)]
    return all(torch.isfinite(t).all() for t in tensors)


@pytest.mark.slow
@pytest.mark.parametrize("scheme,where,sentence", [
    (["strategy=gpipe", "G=1", "R=4"], [], "step 3: the loss of micro-batch 0 (at stage 3) is nan"),
    (["strategy=lpp", "G=2", "R=2"], ["+model.where=grad"],
     "step 3: the gradient from stage 2's backward on micro-batch 0 is nan"),
    # ddp agrees the flag beside its last gradient bucket, and finds the first value as every scheme does
    (["strategy=ddp"], ["+model.where=grad"], "step 3: the gradient from stage 2's backward on micro-batch 0 is nan"),
], ids=["loss-gpipe", "gradient-lpp", "gradient-ddp"])
def test_stop_names_step_microbatch_stage_and_keeps_the_last_finite_checkpoint(tmp_path, scheme, where, sentence):
    run = tmp_path / "run"
    code, out, err = finished(launcher(*scheme, *SMALL, *where, "trainer.max_steps=6", f"hydra.run.dir={run}",
                                       cwd=tmp_path))
    assert code == 1, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err and "NonFiniteError" not in err, err[-3000:]
    assert sentence + ", so training stopped before the step's update (nonfinite=stop; nonfinite=skip drops such " \
                      "steps and goes on)." in errors[0], errors[0]
    last = load_checkpoint(run / "checkpoints" / "last.ckpt")
    assert last["global_step"] == 2  # the checkpoint of step 2, the last finite one
    assert all(all_finite(load_checkpoint(p)) for p in (run / "checkpoints").glob("*.ckpt"))
    assert (run / "failed.json").exists() and not (run / "metrics.json").exists()
    assert not survivors(str(tmp_path))


@pytest.mark.slow
def test_skip_drops_the_step_and_goes_on(tmp_path):
    lpp = ["strategy=lpp", "G=1", "R=2", "trainer.precision=64-true"]
    jobs = {name: launcher(*lpp, *SMALL, f"trainer.max_steps={steps}", *extra, f"hydra.run.dir={tmp_path / name}",
                           cwd=tmp_path)
            for name, steps, extra in (("two", 2, []), ("three", 3, ["nonfinite=skip"]),
                                       ("five", 5, ["nonfinite=skip"]))}
    done = {name: finished(p) for name, p in jobs.items()}
    for name, (code, _, err) in done.items():
        assert code == 0, (name, err[-3000:])
    # step 3 (nan loss) was dropped: no parameter and no optimizer state moved
    two = load_checkpoint(tmp_path / "two/checkpoints/last.ckpt")
    three = load_checkpoint(tmp_path / "three/checkpoints/last.ckpt")
    assert three["global_step"] == 3
    assert all(torch.equal(two["state_dict"][k], three["state_dict"][k]) for k in two["state_dict"])
    s2, s3 = two["optimizer_states"][0]["state"], three["optimizer_states"][0]["state"]
    assert all(torch.equal(s2[i][k], s3[i][k]) for i in s2 for k in s2[i])
    # and training went on
    code, out, err = done["five"]
    assert "warning: step 3 skipped (nonfinite=skip): the loss of micro-batch 0 (at stage 3) is nan." in err
    m = json.loads((tmp_path / "five" / "metrics.json").read_text())
    assert m["skipped_steps"] == 1
    assert [s.get("skipped", False) for s in m["steps"]] == [False, False, True, False, False]
    assert all(s["loss"] == s["loss"] for i, s in enumerate(m["steps"]) if i != 2)  # finite around the skip
    assert all_finite(load_checkpoint(tmp_path / "five/checkpoints/last.ckpt"))
    assert not survivors(str(tmp_path))


def test_refused_before_any_worker_starts(tmp_path):
    _, found = _preflight(["nonfinite=maybe"])
    assert found.fatal == ["nonfinite=maybe is invalid: use stop (a NaN or infinite loss or gradient stops the run) "
                           "or skip (that step is dropped)."]
    run = tmp_path / "run"
    code, out, err = finished(launcher("data.seq_len=0", f"hydra.run.dir={run}", cwd=tmp_path))
    assert code == 2, err[-3000:]
    assert err.strip().splitlines() == [
        "error: data.seq_len=0 is invalid: a sample needs at least one position to predict (with none the loss is "
        "nan); use a positive integer."]
    assert not run.exists()


def test_the_first_value_is_found_in_an_order_every_scheme_shares():
    from launcher.runtime.nonfinite import Finite

    f = Finite(stages=4, microbatches=4)
    f.begin()
    nan, inf = torch.tensor([float("nan")]), torch.tensor([float("inf")])
    f.forward(3, 1, torch.ones(2), nan[0])  # micro-batch 1's loss: later than anything of micro-batch 0
    f.forward(0, 0, torch.ones(2), None)
    f.backward(1, 0, [torch.ones(3), None])
    f.backward(2, 0, [inf, torch.ones(3)])  # stage 2's backward runs before stage 1's
    f.reduced({0: -inf})
    assert f.describe(f.first()) == "the gradient from stage 2's backward on micro-batch 0 is inf"
    f.begin()
    f.reduced({1: torch.ones(3), 0: torch.cat([torch.ones(2), -inf])})
    assert f.describe(f.first()) == "the gradient of stage 0, summed over the micro-batches, is -inf"
    f.begin()
    f.forward(1, 2, (torch.ones(2), torch.arange(3)), None)
    assert f.first() is None


def test_a_skipped_step_leaves_batchnorm_statistics_where_they_were():
    from torch import nn

    from launcher.runtime.nonfinite import undo_statistics
    from launcher.runtime.stats import RunningStats

    owned, skeleton = nn.BatchNorm1d(3), nn.BatchNorm1d(3)
    stats = RunningStats([[owned, skeleton]], 2)
    before = owned.running_mean.clone()
    stats.begin()
    for b in range(2):
        stats.before(0, b, owned)
        owned(torch.randn(4, 3) + 5)
        stats.after(0, b, owned)
    stats.end(None, torch.device("cpu"), 1)
    assert not torch.equal(owned.running_mean, before) and int(owned.num_batches_tracked) == 2
    undo_statistics(stats)
    for bn in (owned, skeleton):
        assert torch.equal(bn.running_mean, before) and int(bn.num_batches_tracked) == 0
