"""Resuming from ``last.ckpt`` is exact, from every checkpoint a run writes.

A run that stops at ``trainer.max_steps`` writes ``last.ckpt`` after Lightning has ended its epoch
early; the data position is kept by the data module itself (:class:`launcher.models.SeededData`),
so the resumed run reads the batches an uninterrupted one reads, across an epoch's end too, under
the same scheme and under another (float64: parameters within 1e-10). A checkpoint that cannot
serve (truncated, another model, already at ``trainer.max_steps``, another learning-rate schedule)
is refused in one sentence, exit 2, before any worker or run directory exists."""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from helpers.cli import finished, start_launcher
from helpers.training import Regressor, last_state, load_checkpoint, max_diff, quiet_trainer, user_loader
from launcher.checkpoint import consolidate
from launcher.lightning import UnifiedStrategy
from launcher.lightning.single import StreamedSingleDevice
from launcher.models import CharCorpus
from launcher.preflight import preflight as _preflight

pytestmark = pytest.mark.timeout(300)

#: 600 characters: 53 training windows, so an epoch is 6 batches of 8 and a 9-step run crosses one
TINY = ["stages=2", "microbatches=2", "data.batch_size=8", "data.seq_len=8", "data.chars=600", "data.val_fraction=0.2",
        "model.n_layer=2", "model.d_model=16", "model.n_head=2", "logger=none", "trainer.precision=64-true",
        "trainer.val_check_interval=1000"]
GPIPE = ["strategy=gpipe", "G=1", "R=2"]


launcher = partial(start_launcher, pythonpath="cwd", start_new_session=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> SimpleNamespace:
    """``first``: 4 steps under gpipe (stops at max_steps mid-epoch); ``whole``: 9 steps uninterrupted;
    then ``first`` resumed to 9 steps under gpipe and under fsdp."""
    tmp = tmp_path_factory.mktemp("resume")
    r = SimpleNamespace(tmp=tmp, **{k: tmp / k for k in ("first", "whole", "same", "other")})
    jobs = [launcher(*GPIPE, *TINY, "model.max_steps=9", "trainer.max_steps=4", f"hydra.run.dir={r.first}", cwd=tmp),
            launcher(*GPIPE, *TINY, "model.max_steps=9", "trainer.max_steps=9", f"hydra.run.dir={r.whole}", cwd=tmp)]
    for p in jobs:
        code, _, err = finished(p)
        assert code == 0, err[-3000:]
    ckpt = r.first / "checkpoints" / "last.ckpt"
    # no model.max_steps here: it follows trainer.max_steps=9, as the first run set it explicitly
    jobs = [launcher(*GPIPE, *TINY, "trainer.max_steps=9", f"ckpt_path={ckpt}", f"hydra.run.dir={r.same}", cwd=tmp),
            launcher("strategy=fsdp", *TINY, "trainer.max_steps=9", f"ckpt_path={ckpt}", f"hydra.run.dir={r.other}",
                     cwd=tmp)]
    r.resumed = [finished(p) for p in jobs]
    return r


@pytest.mark.slow
def test_last_ckpt_at_max_steps_saves_where_the_data_stands(runs):
    ckpt = load_checkpoint(runs.first / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 4
    assert ckpt["CharCorpus"] == {"epoch": 0, "samples": 32, "batches": 4}  # not Lightning's epoch 1


@pytest.mark.slow
@pytest.mark.parametrize("which", ["same", "other"])
def test_resume_equals_the_uninterrupted_run(runs, which):
    code, _, err = runs.resumed[0 if which == "same" else 1]
    assert code == 0, err[-3000:]
    run = getattr(runs, which)
    assert max_diff(last_state(run), last_state(runs.whole)) < 1e-10
    got = json.loads((run / "metrics.json").read_text())["steps"]
    want = json.loads((runs.whole / "metrics.json").read_text())["steps"]
    assert [s["step"] for s in got] == list(range(1, 10))
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(got, want)) < 1e-10


def _fatal(*overrides: str) -> list[str]:
    _, found = _preflight(list(overrides))
    for s in found.fatal:
        assert "\n" not in s and s.endswith("."), s
    return found.fatal


@pytest.mark.slow
def test_a_finished_checkpoint_names_the_key_to_raise(runs):
    ckpt = runs.first / "checkpoints" / "last.ckpt"
    assert _fatal(*GPIPE, *TINY, "trainer.max_steps=4", f"ckpt_path={ckpt}") == [
        f"ckpt_path={ckpt} has trained 4 steps already, and trainer.max_steps=4 asks for no more: raise "
        f"trainer.max_steps above 4 to train on from it."]


@pytest.mark.slow
def test_another_schedule_length_is_refused_unless_asked_for(runs):
    ckpt = runs.first / "checkpoints" / "last.ckpt"
    found = _fatal(*GPIPE, *TINY, "trainer.max_steps=12", f"ckpt_path={ckpt}")
    assert len(found) == 1 and "learning-rate schedule of model.max_steps=9 steps" in found[0], found
    assert "model.max_steps follows trainer.max_steps=12" in found[0] and "set model.max_steps=9" in found[0]
    assert not _fatal(*GPIPE, *TINY, "trainer.max_steps=12", "model.max_steps=12", f"ckpt_path={ckpt}")
    assert not _fatal(*GPIPE, *TINY, "trainer.max_steps=12", "model.max_steps=9", f"ckpt_path={ckpt}")


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_refused(runs):
    ckpt = runs.first / "checkpoints" / "last.ckpt"
    found = _fatal(*GPIPE, *[a for a in TINY if not a.startswith("model.d_model")], "model.d_model=32",
                   "trainer.max_steps=9", f"ckpt_path={ckpt}")
    assert len(found) == 1, found
    assert found[0].startswith(f"ckpt_path={ckpt} holds another model (it was saved with model.d_model=16 there "
                               f"and 32 here): its stages.0.tok.weight has shape [128, 16] where this model's has "
                               f"[128, 32]"), found


@pytest.mark.slow
def test_a_truncated_checkpoint_is_one_sentence_before_anything_runs(runs):
    single = runs.tmp / "single.ckpt"  # gpipe writes a sharded directory: its single-file form
    consolidate(runs.first / "checkpoints" / "last.ckpt", single)
    whole = single.read_bytes()
    cut = runs.tmp / "cut.ckpt"
    cut.write_bytes(whole[: len(whole) // 2])
    run = runs.tmp / "never"
    code, out, err = finished(launcher(*GPIPE, *TINY, "trainer.max_steps=9", f"ckpt_path={cut}",
                                       f"hydra.run.dir={run}", cwd=runs.tmp))
    assert code == 2, err[-3000:]
    assert err.strip().splitlines() == [
        f"error: ckpt_path={cut} is not a whole checkpoint: its {len(whole) // 2:,} bytes end without the archive "
        f"directory torch.save writes last, so it was cut short (or is no checkpoint); resume from another one (the "
        f"run's checkpoints/ keeps one per validation)."]
    assert not run.exists()


class _Loop:
    """What the data module reads of Lightning's loop: the batches trained so far."""

    def __init__(self, trained: int = 0) -> None:
        progress = SimpleNamespace(total=SimpleNamespace(processed=trained))
        self.fit_loop = SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress))
        self.num_training_batches = float("inf")

    def step(self) -> None:
        self.fit_loop.epoch_loop.batch_progress.total.processed += 1


def _train(dm: CharCorpus, trainer: _Loop, steps: int, epoch_ends_after: int | None = None) -> list[torch.Tensor]:
    """``steps`` batches as Lightning feeds them: an iteration per epoch; ``epoch_ends_after``: the
    first epoch ends after that many batches, as a resumed Lightning loop may end it."""
    got: list[torch.Tensor] = []
    limit = epoch_ends_after
    while len(got) < steps:
        for i, (x, _) in enumerate(dm.train_dataloader()):
            got.append(x)
            trainer.step()
            if len(got) == steps or (limit is not None and i + 1 == limit):
                break
        limit = None
    return got


def _module(trainer: _Loop) -> CharCorpus:
    dm = CharCorpus(batch_size=8, seq_len=8, chars=600, val_fraction=0.2)
    dm.setup("fit")
    dm.trainer = trainer  # type: ignore[assignment]
    return dm


@pytest.mark.parametrize("stop", [4, 6, 7])  # mid-epoch, at an epoch's end (6 batches), just after
def test_data_position_follows_the_batches_trained_whatever_lightnings_epochs(stop):
    whole_loop = _Loop()
    whole = _train(_module(whole_loop), whole_loop, 14)
    first_loop = _Loop()
    first = _module(first_loop)
    _train(first, first_loop, stop)
    saved = first.state_dict()
    assert saved["batches"] == stop and (saved["epoch"], saved["samples"]) == divmod(stop * 8, 48)
    loop = _Loop(stop)  # Lightning restores its count with the checkpoint
    resumed = _module(loop)
    resumed.load_state_dict(saved)
    # the resumed loop ends its first epoch wherever it likes (here after one batch): no batch is lost
    rest = _train(resumed, loop, 14 - stop, epoch_ends_after=1)
    assert all(torch.equal(a, b) for a, b in zip(rest, whole[stop:]))


# ---- the user's own DataLoader (shuffle=True, drop_last=False), resumed mid-epoch ----------------------

#: 7 steps of 5-batch epochs (36 samples, the 5th batch of 4), validated (and checkpointed) every 3 batches
USER_STEPS = 7
CLIP = float(OmegaConf.load(Path(__file__).parents[2] / "conf" / "trainer" / "default.yaml").gradient_clip_val)


def _strategy(scheme: str) -> tuple[Any, int]:
    if scheme == "single":
        return StreamedSingleDevice(microbatches=4), 1
    return UnifiedStrategy(scheme, stages=4, microbatches=4, **({"G": 2, "R": 2} if scheme == "fslpp" else {})), 4


def _user_fit(strategy: Any, devices: int, folder: Path, ckpt: Path | None = None,
              **loader: Any) -> dict[str, torch.Tensor]:
    """:class:`Regressor` (dropout on) on the user's loader (``loader``: more DataLoader arguments),
    float64, clipping at the launcher's default, to step 7, keeping each validation's checkpoint
    (``step=3.ckpt``: mid-epoch); from ``ckpt`` if given."""
    L.seed_everything(0, verbose=False)
    model = Regressor(max_steps=USER_STEPS).double()
    saves = ModelCheckpoint(dirpath=folder, filename="{step}", save_top_k=-1)
    tr = quiet_trainer(strategy, devices, precision="64-true", max_steps=USER_STEPS, gradient_clip_val=CLIP,
                       val_check_interval=3, limit_val_batches=1, enable_checkpointing=True, callbacks=[saves])
    train = user_loader()
    if loader:
        train = DataLoader(train.dataset, batch_size=8, shuffle=True, **loader)
    tr.fit(model, train_dataloaders=train, val_dataloaders=user_loader(8, shuffle=False),
           ckpt_path=str(ckpt) if ckpt is not None else None)
    return model.state_dict()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> SimpleNamespace:
    """7 steps without a stop under ``strategy=single`` and under gpipe (a sharded checkpoint), each
    writing ``step=3.ckpt`` at its mid-epoch validation."""
    tmp = tmp_path_factory.mktemp("user-loader")
    r = SimpleNamespace(single=tmp / "single", gpipe=tmp / "gpipe", tmp=tmp)
    r.state = _user_fit(*_strategy("single"), r.single)
    r.gpipe_state = _user_fit(*_strategy("gpipe"), r.gpipe)
    return r


@pytest.mark.parametrize("scheme,written_by", [("single", "single"), ("gpipe", "gpipe"), ("ddp", "single"),
                                               ("fslpp", "gpipe")])
def test_user_loader_resumes_mid_epoch_as_the_uninterrupted_run(uninterrupted, tmp_path, scheme, written_by):
    """From the checkpoint written at step 3's validation (batch 3 of 5 of the first epoch), 4 more
    steps (the epoch's rest and 2 batches of the next) end where the uninterrupted run ends."""
    assert max_diff(uninterrupted.gpipe_state, uninterrupted.state) < 1e-12
    ckpt = getattr(uninterrupted, written_by) / "step=3.ckpt"
    got = _user_fit(*_strategy(scheme), tmp_path / "resumed", ckpt)
    diff = max_diff(got, uninterrupted.state)
    print(f"user loader, {scheme} resumed from {written_by}'s step=3.ckpt: parameters within {diff:.1e}")
    assert diff < 1e-12


def test_without_the_saved_position_the_resume_differs(uninterrupted, tmp_path):
    """What Lightning does with a plain DataLoader (restart the epoch with a new permutation) ends
    elsewhere: the test above is not trivial. Lightning's default strategy still resumes the file."""
    from launcher.lightning.loader_position import KEY

    ckpt = torch.load(uninterrupted.single / "step=3.ckpt", weights_only=False)
    assert [p["taken"] for p in ckpt[KEY]] == [3]  # the training loader's only: 3 batches trained
    del ckpt[KEY]
    plain = tmp_path / "plain.ckpt"
    torch.save(ckpt, plain)
    got = _user_fit(*_strategy("single"), tmp_path / "resumed", plain)
    diff = max_diff(got, uninterrupted.state)
    print(f"user loader, single resumed from step=3.ckpt without its loader position: parameters {diff:.1e} away")
    assert diff > 1e-4
    _user_fit("auto", 1, tmp_path / "auto", uninterrupted.single / "step=3.ckpt")


@pytest.mark.parametrize("kind", ["own generator", "worker process"])
def test_user_loader_variants_resume_exactly(tmp_path, caplog, kind):
    """A loader with its own ``generator=`` resumes unread; one reading in a worker process reads the
    trained batches again to reach its position, and says so once: both as the uninterrupted run."""
    def loader() -> dict[str, Any]:
        return {"generator": torch.Generator().manual_seed(7)} if kind == "own generator" else {"num_workers": 1}

    want = _user_fit(*_strategy("single"), tmp_path / "whole", **loader())
    with caplog.at_level(logging.WARNING, logger="launcher.lightning.loader_position"):
        got = _user_fit(*_strategy("single"), tmp_path / "resumed", tmp_path / "whole" / "step=3.ckpt", **loader())
    assert max_diff(got, want) == 0.0
    said = [r.getMessage() for r in caplog.records if r.name == "launcher.lightning.loader_position"]
    assert said == ([] if kind == "own generator" else [
        "warning: resuming the training DataLoader mid-epoch: the 3 batches already trained on are read again to "
        "reach the next one (num_workers=1: worker processes read the indices ahead); the order is the "
        "uninterrupted run's as long as it depends only on torch's generators."])
