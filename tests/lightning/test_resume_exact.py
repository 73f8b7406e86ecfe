"""Resuming from ``last.ckpt`` is exact, from every checkpoint a run writes.

A run that stops at ``trainer.max_steps`` writes ``last.ckpt`` after Lightning has ended its epoch
early; the data position is kept by the data module itself (:class:`launcher.models.SeededData`),
so the resumed run reads the batches an uninterrupted one reads, across an epoch's end too, under
the same scheme and under another (float64: parameters within 1e-10). A checkpoint that cannot
serve (truncated, another model, already at ``trainer.max_steps``, another learning-rate schedule)
is refused in one sentence, exit 2, before any worker or run directory exists."""

from __future__ import annotations

import json
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from helpers.cli import finished, start_launcher
from helpers.training import last_state, load_checkpoint, max_diff
from launcher.checkpoint import consolidate
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
