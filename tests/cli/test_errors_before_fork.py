"""A model that fails before any worker starts is one sentence and exit 2 under every scheme, as
under ``strategy=single``: its constructor raising, a ``_target_`` whose module cannot be imported,
or its own code raising while the launcher cuts it into stages (a traced ``training_step``, a
``configure_model``) on the data's first micro-batch; the sentence names the user's file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.cli import run_launcher
from launcher.preflight import preflight as _preflight

pytestmark = pytest.mark.timeout(300)

MODULE = '''
import lightning as L
import torch
from torch import nn
from torch.nn import functional as F


class Tiny(L.LightningModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(128, width)
        self.head = nn.Linear(width, 128)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.emb(x)).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RaisesInInit(Tiny):
    def __init__(self, width: int = 8) -> None:
        super().__init__(width)
        raise RuntimeError("no weights for this width")


class RaisesInStep(Tiny):
    def training_step(self, batch, batch_idx):
        raise ValueError("the batch is not what I expected")


class RaisesInConfigureModel(Tiny):
    def configure_model(self):
        raise RuntimeError("configure_model failed")


class Normed(Tiny):
    """BatchNorm in a traced step: its running statistics, updated in forward, are refused."""

    def __init__(self, width: int = 8) -> None:
        super().__init__(width)
        self.norm = nn.BatchNorm1d(width)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.norm(self.emb(x).transpose(1, 2)).transpose(1, 2)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())
'''

BROKEN = "import a_module_that_is_not_installed\n"


def _line(text: str) -> int:
    """The line of ``usermod.py`` that holds ``text``."""
    return next(i for i, ln in enumerate(MODULE.splitlines(), 1) if text in ln)


STEP_LINE, CONFIGURE_LINE = _line("the batch is not what"), _line('"configure_model failed"')

SCHEMES = {"single": ["strategy=single"], "ddp": ["strategy=ddp", "G=2", "R=1"],
           "fsdp": ["strategy=fsdp", "G=2", "R=1"], "gpipe": ["strategy=gpipe", "G=1", "R=2"],
           "lpp": ["strategy=lpp", "G=2", "R=1"], "fslpp": ["strategy=fslpp", "G=2", "R=2"]}
SMALL = ["stages=2", "microbatches=2", "data.batch_size=4", "data.seq_len=8", "data.chars=2000", "logger=none",
         "model=custom", "split=auto"]


@pytest.fixture
def user_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "usermod.py").write_text(MODULE)
    (tmp_path / "brokenmod.py").write_text(BROKEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _fatal(*overrides: str) -> list[str]:
    _, found = _preflight(list(overrides))
    for s in found.fatal:
        assert "\n" not in s and s.endswith("."), s
    return found.fatal


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_a_constructor_that_raises_is_one_sentence(user_code: Path, scheme: str) -> None:
    assert _fatal(*SCHEMES[scheme], *SMALL, "model._target_=usermod.RaisesInInit") == [
        "model._target_=usermod.RaisesInInit could not be built: RuntimeError: no weights for this width."]


@pytest.mark.parametrize("scheme", ["single", "fsdp"])
def test_a_module_that_cannot_be_imported_is_one_sentence(user_code: Path, scheme: str) -> None:
    assert _fatal(*SCHEMES[scheme], *SMALL, "model._target_=brokenmod.Model") == [
        "model._target_=brokenmod.Model could not be built: ModuleNotFoundError: No module named "
        "'a_module_that_is_not_installed'."]


@pytest.mark.parametrize("scheme", list(SCHEMES))  # strategy=single traces too (its random streams' units)
def test_a_step_that_raises_while_traced_is_one_sentence(user_code: Path, scheme: str) -> None:
    assert _fatal(*SCHEMES[scheme], *SMALL, "model._target_=usermod.RaisesInStep") == [
        "model._target_=usermod.RaisesInStep failed before training started, while the launcher cut it into stages "
        "and ran one micro-batch of the data's first batch through them: ValueError: the batch is not what I "
        f"expected (usermod.py, line {STEP_LINE})."]


NORMED = ("BatchNorm1d 'norm' updates 'norm.num_batches_tracked' in place during forward (as BatchNorm updates its "
          "running statistics in train mode), which stages traced from one graph cannot keep in step; give the model "
          "as a list of stage modules (self.stages) instead.")


@pytest.mark.parametrize("scheme", ["single", "gpipe"])
def test_a_step_the_tracer_refuses_is_one_sentence_under_single_as_under_a_scheme(user_code: Path,
                                                                                   scheme: str) -> None:
    """strategy=single traces a module without self.stages as every scheme does: a refusal is the
    same sentence before training (it was a raw SplitError from inside fit, exit 1)."""
    by = ("strategy=single (which traces it as every scheme does, for the random streams)" if scheme == "single"
          else "the schedule")
    assert _fatal(*SCHEMES[scheme], *SMALL, "model._target_=usermod.Normed") == [
        f"model._target_=usermod.Normed cannot be trained by {by}: {NORMED}"]


def test_configure_model_that_raises_is_one_sentence(user_code: Path) -> None:
    found = _fatal(*SCHEMES["gpipe"], *SMALL, "model._target_=usermod.RaisesInConfigureModel")
    assert len(found) == 1 and found[0].startswith("model._target_=usermod.RaisesInConfigureModel failed before "
                                                   "training started"), found
    assert found[0].endswith(f"RuntimeError: configure_model failed (usermod.py, line {CONFIGURE_LINE})."), found


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["fslpp", "single"])
def test_the_command_prints_the_sentence_alone_and_exits_2(tmp_path: Path, scheme: str) -> None:
    (tmp_path / "usermod.py").write_text(MODULE)
    run = tmp_path / "run"
    p = run_launcher(*SCHEMES[scheme], *SMALL, "model._target_=usermod.RaisesInStep", f"hydra.run.dir={run}",
                     cwd=tmp_path, pythonpath="cwd", timeout=240)
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.strip().splitlines() == [
        "error: model._target_=usermod.RaisesInStep failed before training started, while the launcher cut it into "
        "stages and ran one micro-batch of the data's first batch through them: ValueError: the batch is not what I "
        f"expected (usermod.py, line {STEP_LINE})."]
    assert not run.exists()  # no worker, no run directory
