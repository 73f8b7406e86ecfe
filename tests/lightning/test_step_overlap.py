"""``step_overlap=post_validation`` under ``strategy=gpipe`` (:mod:`launcher.lightning.step_overlap`):
no end-of-step all-reduce, each stage steps on the partial state from the stages after it and is
validated against the full one. Float64 at the launcher's defaults (clipping 1.0, dropout, shuffled
loader with a smaller last batch); the loss is scaled up so that clipping binds at some steps and the
later stages' provisional steps really roll back (asserted). Equal to Lightning's single-device
strategy; a planted non-finite gradient at the first stage is dropped as the synchronous step drops it."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from helpers.cli import SMALL_RUN, run_launcher
from helpers.training import Regressor, max_diff, quiet_trainer
from launcher.lightning import UnifiedStrategy
from launcher.lightning.single import StreamedSingleDevice

pytestmark = pytest.mark.timeout(400)

TOL = 1e-10
STEPS = 5  # 36 samples in batches of 8: the 5th batch holds 4
#: the gradient clipping a user of the launcher gets
CLIP = float(OmegaConf.load(Path(__file__).parents[2] / "conf" / "trainer" / "default.yaml").gradient_clip_val)
SCALE = 2.5


class Scaled(Regressor):
    """The user's regressor, its loss scaled so the clipping at 1.0 binds at some steps and not others;
    ``optimizer``: AdamW with the cosine schedule, or SGD with momentum."""

    def __init__(self, scale: float, optimizer: str = "adamw") -> None:
        super().__init__(max_steps=STEPS)
        self.scale, self.opt_name = scale, optimizer

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.scale * super().loss(out, y)

    def configure_optimizers(self) -> Any:
        if self.opt_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        if self.opt_name == "adagrad":  # no in-place inverse here: the synchronous step
            return torch.optim.Adagrad(self.parameters(), lr=0.05)
        return super().configure_optimizers()


class Rollbacks(L.Callback):
    """Each worker's rollbacks and dropped steps, written where the test reads them (forked workers)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pv = getattr(trainer.strategy, "post_validation", None)
        if pv is not None:
            torch.save({"stage": pv.lowest, "rollbacks": pv.step.rollbacks, "skipped": pv.step.skipped},
                       self.out / f"rank{dist.get_rank()}.pt")


def fit(strategy: Any, devices: int, optimizer: str, scale: float = SCALE, out: Path | None = None,
        model_class: type[Scaled] = Scaled, planted: bool = False, **trainer: Any) -> L.LightningModule:
    L.seed_everything(0, verbose=False)
    model = model_class(scale, optimizer).double()
    cbs = [Rollbacks(out)] if out is not None else []
    tr = quiet_trainer(strategy, devices, precision="64-true", max_steps=STEPS, gradient_clip_val=CLIP,
                       limit_val_batches=0, callbacks=cbs, **trainer)
    tr.fit(model, train_dataloaders=loader(planted))
    return model


def loader(planted: bool = False) -> DataLoader:
    """``helpers.training.user_loader(36)``'s data (shuffled, the last batch of 4), one sample marked
    where ``planted`` (:class:`Planted` makes its gradient at the first stage nan)."""
    g = torch.Generator().manual_seed(36)
    x, y = torch.randn(36, 8, generator=g, dtype=torch.float64), torch.randn(36, 8, generator=g, dtype=torch.float64)
    if planted:
        x[5, 0] = 1e3
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)


class _NanBackward(torch.autograd.Function):
    """The identity, whose backward is nan on the marked rows: a finite forward, a non-finite gradient."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, marked: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(marked)
        return h.view_as(h)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        (marked,) = ctx.saved_tensors
        return g.masked_fill(marked, float("nan")), None


class _PlantedLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NanBackward.apply(super().forward(x), x[:, :1] > 100)


class Planted(Scaled):
    """The first stage's weight gradient is nan in the step that reads the marked sample: only the first
    stage sees it, after the later stages have stepped provisionally on a finite partial state."""

    def __init__(self, scale: float, optimizer: str = "adamw") -> None:
        super().__init__(scale, optimizer)
        first = self.stages[0][0]
        planted = _PlantedLinear(first.in_features, first.out_features)
        planted.load_state_dict(first.state_dict())
        self.stages[0][0] = planted


def per_worker(out: Path) -> dict[int, dict[str, int]]:
    found = [torch.load(p) for p in sorted(out.glob("rank*.pt"))]
    return {f["stage"]: f for f in found}


#: (optimizer, loss scale, the steps of 5 whose clipping binds only on the full norm: rolled back on every
#: worker but the first, scheme and its settings): gpipe (4 workers) in its default order and the
#: zero-bubble orders (W deferred), and a looped pipeline (lpp): 2 workers of two stages each
SPLIT = {"split_backward": True}
CASES = [("adamw", 2.5, 3, "gpipe", {}), ("sgd", 2.0, 1, "gpipe", {}),
         ("adamw", 2.5, 3, "gpipe", {"order": "zb_h1", **SPLIT}),
         ("adamw", 2.5, 3, "gpipe", {"order": "zb_h2", **SPLIT}),
         ("adamw", 2.5, 3, "gpipe", {"order": "auto", "memory_limit": 8, **SPLIT}),  # memory_limit=2p at p=4
         ("adamw", 2.5, 3, "lpp", {"G": 1, "R": 2, "order": "interleaved_1f1b", **SPLIT}),
         ("sgd", 2.0, 1, "lpp", {"G": 1, "R": 2, "order": "1f1b"})]


@pytest.mark.parametrize("optimizer,scale,bound,scheme,kw", CASES,
                         ids=[f"{c[0]}-{c[3]}-{c[4].get('order', 'default')}" for c in CASES])
def test_post_validation_equals_one_device(tmp_path, optimizer, scale, bound, scheme, kw):
    # strategy=single: the same module on one device, dropout drawn per micro-batch as the workers draw it
    ref = fit(StreamedSingleDevice(microbatches=4), 1, optimizer, scale)
    st = UnifiedStrategy(scheme, stages=4, microbatches=4, step_overlap="post_validation", **kw)
    model = fit(st, st.workers, optimizer, scale, out=tmp_path)
    assert max_diff(ref, model) < TOL
    workers = per_worker(tmp_path)  # by each worker's lowest stage
    # the first worker steps on the full state; each later one on a partial norm under 1.0 where the full
    # one binds: rolled back and stepped again at some steps, not at all (the clipping binds at some only)
    assert {s: w["rollbacks"] for s, w in workers.items()} == {s: bound if s else 0 for s in range(st.workers)}
    assert 0 < bound < STEPS
    assert all(w["skipped"] == 0 for w in workers.values())


@pytest.mark.parametrize("scheme,kw", [("fslpp", {"G": 2, "R": 2}), ("lpp", {"G": 2, "R": 2}), ("ddp", {}),
                                       ("vshape", {})])
def test_refused_where_a_stage_has_several_owners_or_the_loss_is_not_last(scheme, kw):
    from launcher.config import ConfigError

    with pytest.raises(ConfigError, match=f"step_overlap=post_validation is invalid with mode=train and "
                                          f"strategy={scheme}"):
        UnifiedStrategy(scheme, stages=4, microbatches=4, step_overlap="post_validation", **kw)


def test_planted_nonfinite_is_rolled_back_and_skipped(tmp_path):
    """nonfinite=skip: the step whose first stage finds a nan is dropped by every stage (the later ones
    roll their provisional steps back), as the synchronous step drops it; the other steps go on."""
    sync = fit(UnifiedStrategy("gpipe", stages=4, microbatches=4, nonfinite="skip"), 4, "adamw", planted=True,
               model_class=Planted)
    st = UnifiedStrategy("gpipe", stages=4, microbatches=4, nonfinite="skip", step_overlap="post_validation")
    model = fit(st, 4, "adamw", out=tmp_path, planted=True, model_class=Planted)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert max_diff(sync, model) < TOL
    workers = per_worker(tmp_path)
    assert workers[0]["rollbacks"] == workers[0]["skipped"] == 0  # it saw the nan itself: no step taken
    for s in (1, 2, 3):  # the dropped step's rollback, and those of the steps whose clipping binds
        assert (workers[s]["rollbacks"], workers[s]["skipped"]) == (3, 1), workers


@pytest.mark.slow
def test_command_line_counts_rollbacks(tmp_path):
    """``python -m launcher strategy=gpipe step_overlap=post_validation``: each worker's rollbacks in
    ``metrics.json`` and on the console; the run's step cost is marked as the overlapped one's."""
    run = tmp_path / "run"
    p = run_launcher("strategy=gpipe", *SMALL_RUN, "trainer.max_steps=4", "logger=none",
                     "step_overlap=post_validation", f"hydra.run.dir={run}", cwd=tmp_path, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    m = json.loads((run / "metrics.json").read_text())
    rollbacks = m["post_validation"]["rollbacks"]
    assert len(rollbacks) == 4 and rollbacks[0] == 0 and m["post_validation"]["skipped"] == [0, 0, 0, 0]
    assert m["step_cost_s"]["step_overlap"] == "post_validation"
    # the prediction charges each worker's redone steps (measured), and prices both rules with one model
    redo = m["post_validation"]["redo_s"]
    assert len(redo) == 4 and redo[0] == 0.0 and all((r > 0) == (n > 0) for r, n in zip(redo, rollbacks))
    steady, cpu = m["step_cost_s"]["predicted_steady"], m["step_cost_s"]["cpu_s"]
    assert steady["post_validation"] == m["step_cost_s"]["predicted_post_validation"] and steady["none"] > 0
    assert cpu["predicted"] > 0 and cpu["measured"] > 0
    assert f"post_validation: rollbacks per worker {rollbacks}" in p.stdout


def test_planted_nonfinite_stops_with_the_synchronous_sentence(tmp_path):
    """nonfinite=stop (the default): the later stages roll their provisional steps back, then every worker
    stops with the sentence the synchronous step gives."""
    st = UnifiedStrategy("gpipe", stages=4, microbatches=4, step_overlap="post_validation")
    with pytest.raises(Exception, match="step 3: the gradient from stage 0's backward on micro-batch 0 is nan, so "
                                        r"training stopped before the step's update \(nonfinite=stop"):
        fit(st, 4, "adamw", planted=True, model_class=Planted)


def test_an_optimizer_that_cannot_roll_back_takes_the_synchronous_step(tmp_path):
    """Adagrad under post_validation: one warning saying why, and the synchronous step (equal to one device)."""
    ref = fit(StreamedSingleDevice(microbatches=4), 1, "adagrad")
    st = UnifiedStrategy("gpipe", stages=4, microbatches=4, step_overlap="post_validation")
    said = logging.FileHandler(tmp_path / "warnings.log")  # the forked workers inherit it
    logger = logging.getLogger("launcher.lightning.strategy")
    logger.addHandler(said)
    try:
        model = fit(st, 4, "adagrad", out=tmp_path)
    finally:
        logger.removeHandler(said)
        said.close()
    assert max_diff(ref, model) < TOL
    assert not list(tmp_path.glob("rank*.pt"))  # no worker built the post-validation
    assert (tmp_path / "warnings.log").read_text().splitlines() == [
        "warning: step_overlap=post_validation takes the synchronous step here: Adagrad cannot be rolled back in "
        "place: its accumulated squared gradients are not implemented here."]
