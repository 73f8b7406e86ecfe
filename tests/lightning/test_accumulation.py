"""``accumulate_grad_batches=k`` under every scheme is Lightning's own accumulation on one device:
one optimizer step over k batches (each batch's loss divided by k, as Lightning divides it), the
gradient clipped once per optimizer step, ``global_step`` and the learning-rate schedule counting
optimizer steps, and the epoch's last, shorter window stepping on its last batch.

Float64 at the launcher's defaults: gradient clipping 1.0, dropout on (the oracle is
``strategy=single``'s strategy, whose micro-batches draw from the random streams as the schemes'
do), the user's own ``DataLoader(shuffle=True)`` with ``drop_last=False`` (36 samples in batches of
8: an epoch is 5 batches, the last of 4, so with k=2 its third step is a window of one batch)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
from omegaconf import OmegaConf

from helpers.cli import SMALL_RUN
from helpers.oracle import assert_scheme_equals_single_device
from helpers.training import Regressor, max_diff, quiet_trainer, user_loader
from launcher.lightning import UnifiedStrategy
from launcher.lightning.single import StreamedSingleDevice

pytestmark = pytest.mark.timeout(400)

TOL = 1e-10
CLIP = float(OmegaConf.load(Path(__file__).parents[2] / "conf" / "trainer" / "default.yaml").gradient_clip_val)
K, STEPS, B = 2, 4, 4  # 4 optimizer steps over 7 batches: windows (0,1) (2,3) (4) | (0,1) of the next epoch


def fit(strategy, devices: int, k: int = K) -> tuple[dict, L.Trainer]:
    L.seed_everything(0, verbose=False)
    model = Regressor(max_steps=STEPS).double()
    tr = quiet_trainer(strategy, devices, precision="64-true", max_steps=STEPS, gradient_clip_val=CLIP,
                       accumulate_grad_batches=k, limit_val_batches=0)
    tr.fit(model, train_dataloaders=user_loader())
    return model.state_dict(), tr


@pytest.fixture(scope="module")
def oracle() -> dict:
    """One device, Lightning's own accumulation, each batch's micro-batches through the streams."""
    state, tr = fit(StreamedSingleDevice(microbatches=B), 1)
    # 4 optimizer steps read 7 batches: the epoch's short window (its 5th batch alone) stepped
    assert tr.global_step == STEPS and tr.fit_loop.epoch_loop.batch_progress.total.ready == 7
    return state


def test_accumulation_matters(oracle: dict) -> None:
    """Without accumulation the same 4 steps end elsewhere: the equalities below are not trivial."""
    plain, _ = fit(StreamedSingleDevice(microbatches=B), 1, k=1)
    assert max_diff(oracle, plain) > 1e-3


@pytest.mark.parametrize("scheme", ["ddp", "gpipe", "fslpp"])
def test_scheme_accumulates_as_lightning_does_on_one_device(scheme: str, oracle: dict) -> None:
    kw = {"G": 2, "R": 2} if scheme == "fslpp" else {}
    state, _ = fit(UnifiedStrategy(scheme, stages=4, microbatches=B, **kw), 4)
    diff = max_diff(oracle, state)
    print(f"accumulate_grad_batches={K}, {scheme}: parameters within {diff:.1e} of one device")
    assert diff < TOL


@pytest.mark.slow
def test_command_line_accumulation_equals_strategy_single(tmp_path: Path) -> None:
    """``trainer.accumulate_grad_batches=2`` on the command line (the built-in GPT and data, gpipe)
    equals ``strategy=single`` with the same accumulation; ``metrics.json`` lists each batch's engine
    step with the optimizer step it belongs to."""
    overrides = [*SMALL_RUN, "trainer.max_steps=2", "trainer.accumulate_grad_batches=2", "trainer.precision=64-true",
                 "logger=none"]
    assert_scheme_equals_single_device("gpipe", overrides, tmp_path)
    steps = json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"]
    assert [s["optimizer_step"] for s in steps] == [1, 1, 2, 2]
