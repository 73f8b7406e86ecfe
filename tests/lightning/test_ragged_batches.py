"""A last batch smaller than the others (``DataLoader``'s default ``drop_last=False``) trains under
every scheme to the parameters of ``strategy=single`` on the same batches: a traced module (its
graph takes micro-batches of any size) and a module with stages alike, at the launcher's defaults
(gradient clipping on, the model's dropout on, ``shuffle=True``), float64, within 1e-10.

Two steps of batches of 8 over 14 or 10 samples: step 2's batch has 6 (micro-batches of 2, 2, 1
and 1 samples, weighed by their rows) or 2, fewer than the 4 micro-batches (one micro-batch per
sample; the schedule's other two weigh nothing), which ddp and fsdp, a micro-batch per worker, meet
with workers that hold no sample. Validation runs on one batch of 3 samples. Also BatchNorm stages
(their running statistics compared) and ``model=hf``'s module on such a batch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from helpers.oracle import assert_scheme_equals_single_device
from helpers.training import max_diff, quiet_trainer
from launcher.lightning import UnifiedStrategy
from launcher.lightning.single import StreamedSingleDevice
from launcher.lightning.staging import check_staging

pytestmark = pytest.mark.timeout(300)

TOL = 1e-10
B = 4  # micro-batches
#: the gradient clipping a user of the launcher gets
CLIP = float(OmegaConf.load(Path(__file__).parents[2] / "conf" / "trainer" / "default.yaml").gradient_clip_val)


class Regressor(L.LightningModule):
    """Four blocks with dropout, as ``self.stages`` with ``self.loss`` (``staged``), or as one
    body whose ``training_step`` is traced and cut (``split=auto``)."""

    def __init__(self, staged: bool) -> None:
        super().__init__()
        blocks = [nn.Sequential(nn.Linear(6 if i == 0 else 8, 8), nn.Dropout(0.2), nn.Tanh()) for i in range(3)]
        blocks.append(nn.Sequential(nn.Dropout(0.2), nn.Linear(8, 3)))
        self.stages = nn.ModuleList(blocks) if staged else None
        self.body = None if staged else nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.body is not None:
            return self.body(x)
        for m in self.stages or ():
            x = m(x)
        return x

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", self.loss(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class ConvNet(Regressor):
    """Stages with BatchNorm (2-d: a single sample still has 4 values per channel), whose running
    statistics a stand-in micro-batch must leave alone."""

    def __init__(self) -> None:
        super().__init__(staged=True)
        self.stages = nn.ModuleList([
            nn.Sequential(nn.Unflatten(1, (1, 2, 3)), nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()),
            nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()),
            nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(24, 8), nn.Tanh()), nn.Linear(8, 3)])


def llama() -> L.LightningModule:
    """``model=hf``'s module (stages cut from the model's own modules), a tiny Llama."""
    from launcher.models import HFCausalLM

    return HFCausalLM(arch="llama", config=dict(num_hidden_layers=2, hidden_size=16, intermediate_size=32,
                                                num_attention_heads=2, num_key_value_heads=1), max_steps=2)


def samples(n: int, seed: int, tokens: bool = False) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    if tokens:  # windows of 9 characters: input and next-character target
        w = torch.randint(0, 128, (n, 9), generator=g)
        return TensorDataset(w[:, :-1].contiguous(), w[:, 1:].contiguous())
    return TensorDataset(torch.randn(n, 6, generator=g, dtype=torch.float64),
                         torch.randn(n, 3, generator=g, dtype=torch.float64))


def fit(kind: str, n: int, strategy: Any, devices: int) -> tuple[dict[str, torch.Tensor], float]:
    """Two steps over ``n`` samples in shuffled batches of 8 (the last one ragged), then
    ``val_loss`` on 3 samples: the trained state and ``val_loss``."""
    L.seed_everything(0, verbose=False)
    model = {"batchnorm": ConvNet, "hf": llama}.get(kind, lambda: Regressor(staged=kind == "staged"))().double()
    tr = quiet_trainer(strategy, devices, precision="64-true", max_steps=2, gradient_clip_val=CLIP,
                       val_check_interval=2, limit_val_batches=1)
    tokens = kind == "hf"
    tr.fit(model, train_dataloaders=DataLoader(samples(n, 1, tokens), batch_size=8, shuffle=True),
           val_dataloaders=DataLoader(samples(3, 2, tokens), batch_size=8))
    return model.state_dict(), float(tr.callback_metrics["val_loss"])


def split_of(kind: str) -> str | None:
    return "auto" if kind == "traced" else None


#: (module, scheme, G, R, samples): each scheme with a traced module and a module with stages, on
#: a last batch of 6 (uneven micro-batches) or of 2 (fewer samples than micro-batches); BatchNorm's
#: running statistics (in the state compared) with stand-ins; model=hf's module
CASES = [("traced", "ddp", 4, 1, 10), ("traced", "fsdp", 4, 1, 14), ("traced", "gpipe", 1, 4, 10),
         ("traced", "lpp", 2, 2, 14), ("traced", "fslpp", 2, 2, 10),
         ("staged", "ddp", 4, 1, 14), ("staged", "fsdp", 4, 1, 10), ("staged", "gpipe", 1, 4, 14),
         ("staged", "lpp", 2, 2, 10), ("staged", "fslpp", 2, 2, 14), ("batchnorm", "ddp", 4, 1, 10),
         ("hf", "fsdp", 4, 1, 10)]


@pytest.fixture(scope="module")
def oracles() -> dict[tuple[str, int], tuple[dict[str, torch.Tensor], float]]:
    """``strategy=single``'s strategy: one device, each batch's micro-batches through the random
    streams the schemes draw dropout from."""
    cache: dict[tuple[str, int], tuple[dict[str, torch.Tensor], float]] = {}

    def get(kind: str, n: int) -> tuple[dict[str, torch.Tensor], float]:
        if (kind, n) not in cache:
            cache[(kind, n)] = fit(kind, n, StreamedSingleDevice(microbatches=B, split=split_of(kind)), 1)
        return cache[(kind, n)]

    return get  # type: ignore[return-value]


@pytest.mark.parametrize("kind,scheme,G,R,n", CASES, ids=[f"{c[0]}-{c[1]}-last{c[4] - 8}" for c in CASES])
def test_ragged_last_batch_equals_single_device(kind: str, scheme: str, G: int, R: int, n: int, oracles) -> None:
    want, want_val = oracles(kind, n)
    got, got_val = fit(kind, n, UnifiedStrategy(scheme, G=G, R=R, stages=4, microbatches=B, split=split_of(kind)), 4)
    assert max_diff(want, got) < TOL
    assert abs(got_val - want_val) < TOL


def test_dropout_is_on_and_the_last_batch_counts(oracles) -> None:
    """The equalities above are not those of a model that draws nothing or of a step that skips
    the short batch: Lightning's own strategy (the whole batch, torch's generator) ends elsewhere,
    and so does one device on the first batch alone."""
    want, _ = oracles("traced", 10)
    plain, _ = fit("traced", 10, "auto", 1)
    assert max_diff(want, plain) > 1e-4
    L.seed_everything(0, verbose=False)
    model = Regressor(staged=False).double()
    quiet_trainer(StreamedSingleDevice(microbatches=B, split="auto"), precision="64-true", max_steps=1,
                  gradient_clip_val=CLIP, limit_val_batches=0).fit(
        model, train_dataloaders=DataLoader(samples(10, 1), batch_size=8, shuffle=True))
    assert max_diff(want, model.state_dict()) > 1e-4


class FixedRows(nn.Module):
    """A forward whose code fixes the batch size (``view(4, -1)``), as some models' do."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x.view(4, -1))))


class OneSampleBranch(nn.Module):
    """A forward that does something else for one sample: a graph traced on more would skip it
    (export assumes a symbolic size is not 1), so the split is checked on one sample and keeps
    the example's size."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h * 2 if x.shape[0] == 1 else h)


class Traced(L.LightningModule):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.body(x), y)


def test_the_input_check_still_refuses_a_real_mismatch() -> None:
    """A traced graph takes micro-batches of any number of samples, but not another shape of
    sample; a graph whose code fixes the batch size refuses a smaller one in one sentence that
    names the way out (drop_last=True)."""
    batch = (torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64))
    model = Traced(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))).double()
    stage0 = check_staging(model, 2, "auto", batch, 2).model.stages[0]
    stage0((batch[0][:1], batch[1][:1]))  # one sample: taken
    with pytest.raises(ValueError, match=r"^stage 0 was traced on an input 'batch_0' of shape \(n, 8\) and dtype "
                                         r"torch.float64, and got one of shape \(n, 5\)"):
        stage0((batch[0][:3, :5], batch[1][:3]))
    for body, rows in ((FixedRows(), 3), (OneSampleBranch(), 1)):
        stage0 = check_staging(Traced(body).double(), 2, "auto", batch, 2).model.stages[0]
        with pytest.raises(ValueError, match=rf"^stage 0 takes micro-batches .*4.*, not one of {rows}\b.*, so "
                                             r"give its DataLoaders drop_last=True"):
            stage0((batch[0][:rows], batch[1][:rows]))


def test_a_fixed_batch_size_and_a_last_smaller_batch_are_refused_before_training() -> None:
    """What the launcher checks before any worker starts (as ``python -m launcher`` does): a graph
    whose code fixes the batch size, and a DataLoader whose last batch is smaller, are refused in
    one sentence naming drop_last=True; with drop_last=True the same module is taken."""
    from launcher.torch_support.checks import ModelError

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(14, 8, generator=g), torch.randn(14, 2, generator=g))
    for drop_last in (False, True):
        strategy = UnifiedStrategy("ddp", stages=2, microbatches=2, split="auto")
        loader = DataLoader(data, batch_size=8, shuffle=True, drop_last=drop_last)
        if drop_last:
            strategy.check_before_fork(Traced(FixedRows()), train_dataloaders=loader)
            continue
        with pytest.raises(ModelError, match=r"^the training DataLoader's batches of 6 samples are cut into "
                                             r"micro-batches of 3, and stage 0 takes micro-batches .*, not one of 3\b.*"
                                             r"drop_last=True") as e:
            strategy.check_before_fork(Traced(FixedRows()), train_dataloaders=loader)
        assert len(e.value.sentences) == 1


#: a user's traced module (dropout on) and data module: 14 samples in shuffled batches of 8
USER_CODE = '''
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Reg(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(6 if i == 0 else 8, 8), nn.Dropout(0.2), nn.Tanh())
                                    for i in range(3)], nn.Linear(8, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.body(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Data(L.LightningDataModule):
    def __init__(self, batch_size: int = 8, n: int = 14) -> None:
        super().__init__()
        self.batch_size, self.n = batch_size, n

    def setup(self, stage=None):
        g = torch.Generator().manual_seed(1)
        self.train_set = TensorDataset(torch.randn(self.n, 6, generator=g), torch.randn(self.n, 3, generator=g))

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)
'''


@pytest.mark.slow
def test_the_command_line_trains_a_traced_module_on_a_last_smaller_batch(tmp_path: Path, monkeypatch) -> None:
    """Issue 46's run: ``python -m launcher model=custom split=auto`` on a DataLoader whose second
    batch has 6 samples exits 0, and its ``last.ckpt`` equals ``strategy=single``'s."""
    (tmp_path / "ragged_user.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))  # the oracle builds the same classes in this process
    monkeypatch.delitem(sys.modules, "ragged_user", raising=False)
    assert_scheme_equals_single_device("fslpp", [
        "G=2", "R=2", "stages=4", "microbatches=4", "split=auto", "model=custom", "model._target_=ragged_user.Reg",
        "data=custom", "data._target_=ragged_user.Data", "data.batch_size=8", "+data.n=14", "trainer.max_steps=2",
        "trainer.precision=64-true", "trainer.val_check_interval=2", "logger=none"], tmp_path)
