"""The user's data reaches the engine as one device sees it: the batches a DataLoader makes (dicts
included) reach a traced ``training_step`` unchanged, in the order one device reads them (a shuffled
loader too: nothing the launcher runs before training draws from the user's random state), from
``trainer.fit(model, train_dataloaders=...)`` as from a datamodule.

Each training test is float64 at the launcher's defaults otherwise (gradient clipping on at
``conf/trainer/default.yaml``'s value) and equals the same LightningModule under Lightning's
default single-device strategy within 1e-10; the schemes are spread over the tests.
"""

from __future__ import annotations

import importlib
import random
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, TensorDataset

from helpers.cli import run_launcher
from helpers.training import last_state, max_diff, quiet_trainer
from launcher.lightning import UnifiedStrategy
from launcher.lightning.staging import check_staging

pytestmark = pytest.mark.timeout(400)

TOL = 1e-10
STEPS = 3
#: the gradient clipping a user of the launcher gets
CLIP = float(OmegaConf.load(Path(__file__).parents[2] / "conf" / "trainer" / "default.yaml").gradient_clip_val)

#: a user's own code, as a module on the path: a LightningModule around a Hugging Face causal LM
#: (random weights, no download) whose training step takes dict batches, and its data
USER_CODE = '''
import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import AutoConfig, AutoModelForCausalLM


class Tokens(Dataset):
    """Random token sequences (their own generator), as dicts of input_ids and labels."""

    def __init__(self, n: int = 64, seq_len: int = 8, vocab: int = 32) -> None:
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class TokenData(L.LightningDataModule):
    def __init__(self, batch_size: int, shuffle: bool = True) -> None:
        super().__init__()
        self.batch_size, self.shuffle = batch_size, shuffle

    def setup(self, stage: str) -> None:
        self.train_set = Tokens()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle)


class CausalLM(L.LightningModule):
    def __init__(self, vocab: int = 32) -> None:
        super().__init__()
        config = AutoConfig.for_model("llama", vocab_size=vocab, num_hidden_layers=2, hidden_size=16,
                                      intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)
        self.model = AutoModelForCausalLM.from_config(config)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)
'''


@pytest.fixture(scope="module")
def user_code(tmp_path_factory: pytest.TempPathFactory):
    """``USER_CODE`` written to a folder on ``sys.path`` (for this process and the command's) and imported."""
    folder = tmp_path_factory.mktemp("user")
    (folder / "user_code.py").write_text(USER_CODE)
    sys.path.insert(0, str(folder))
    sys.modules.pop("user_code", None)
    try:
        yield folder, importlib.import_module("user_code")
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("user_code", None)


def fit(model: L.LightningModule, strategy, devices: int, **data) -> L.Trainer:
    """``trainer.fit(model, **data)`` for 3 steps in float64 at the launcher's gradient clipping."""
    tr = quiet_trainer(strategy, devices, precision="64-true", max_steps=STEPS, gradient_clip_val=CLIP,
                       val_check_interval=STEPS, limit_val_batches=2)
    tr.fit(model, **data)
    return tr


def test_dict_batches_reach_a_traced_training_step(user_code) -> None:
    """``self.model(**batch).loss`` on dict batches, traced and cut (``split=auto``) under FSDP,
    with the loader given to ``trainer.fit`` itself: equal to one device."""
    _, code = user_code

    def run(strategy, devices: int) -> dict:
        L.seed_everything(0, verbose=False)
        model = code.CausalLM()
        fit(model, strategy, devices, train_dataloaders=DataLoader(code.Tokens(), batch_size=8))
        return model.state_dict()

    want = run("auto", 1)
    got = run(UnifiedStrategy("fsdp", stages=4, microbatches=4, split="auto"), 4)
    diff = max_diff(want, got)
    print(f"dict batches, train_dataloaders=, fsdp: parameters within {diff:.1e} of one device")
    assert diff < TOL


@pytest.mark.slow
def test_shuffled_dict_batches_through_the_command_line(user_code, tmp_path: Path) -> None:
    """``model=custom data=custom split=auto`` with a shuffling DataLoader under LPP: the command's
    look at the first batch (the input check, the trace) leaves the order the loader draws from
    torch's generator as one device has it."""
    folder, code = user_code
    run = tmp_path / "run"
    p = run_launcher("strategy=lpp", "G=2", "R=2", "stages=4", "microbatches=4", "split=auto",
                     "model=custom", "model._target_=user_code.CausalLM", "data=custom",
                     "data._target_=user_code.TokenData", "data.batch_size=8", f"trainer.max_steps={STEPS}",
                     "trainer.precision=64-true", "logger=none", f"hydra.run.dir={run}", cwd=folder, timeout=380)
    assert p.returncode == 0, p.stderr[-3000:]
    L.seed_everything(0, verbose=False)  # the command's seed (seed=0), then the data and the model as it builds them
    data = code.TokenData(batch_size=8)
    model = code.CausalLM()
    fit(model, "auto", 1, datamodule=data)
    diff = max_diff(model.state_dict(), last_state(run))
    print(f"shuffled dict batches, command line, lpp: parameters within {diff:.1e} of one device")
    assert diff < TOL


class LitAutoEncoder(L.LightningModule):
    """Lightning's own first example (its documentation's ``LitAutoEncoder``), on 8x8 images."""

    def __init__(self, encoder: torch.nn.Module, decoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder

    def training_step(self, batch, batch_idx):
        x, _ = batch
        x = x.view(x.size(0), -1)
        z = self.encoder(x)
        x_hat = self.decoder(z)
        loss = torch.nn.functional.mse_loss(x_hat, x)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, _ = batch
        x = x.view(x.size(0), -1)
        loss = torch.nn.functional.mse_loss(self.decoder(self.encoder(x)), x)
        self.log("val_loss", loss)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def autoencoder() -> LitAutoEncoder:
    encoder = torch.nn.Sequential(torch.nn.Linear(8 * 8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    decoder = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8 * 8))
    return LitAutoEncoder(encoder, decoder)


def images(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(n)
    return TensorDataset(torch.rand(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))


@pytest.mark.parametrize("scheme", ["gpipe", "ddp"])
def test_lit_autoencoder_with_train_and_val_dataloaders(scheme: str) -> None:
    """``trainer.fit(model, train_dataloaders=loader, val_dataloaders=...)`` as Lightning documents it,
    with a shuffling loader, through :class:`UnifiedStrategy`: parameters and ``val_loss`` equal one device's."""

    def run(strategy, devices: int) -> tuple[dict, float]:
        L.seed_everything(0, verbose=False)
        model = autoencoder()
        tr = fit(model, strategy, devices, train_dataloaders=DataLoader(images(64), batch_size=8, shuffle=True),
                 val_dataloaders=DataLoader(images(16), batch_size=8))
        return model.state_dict(), float(tr.callback_metrics["val_loss"])

    want, want_val = run("auto", 1)
    got, got_val = run(UnifiedStrategy(scheme, stages=4, microbatches=4, split="auto"), 4)
    diff = max_diff(want, got)
    print(f"LitAutoEncoder, {scheme}: parameters within {diff:.1e}, val_loss within {abs(got_val - want_val):.1e}")
    assert diff < TOL
    assert abs(got_val - want_val) < TOL


def _state() -> tuple:
    return (random.getstate(), np.random.get_state()[1].tolist(), torch.random.get_rng_state())


@pytest.mark.parametrize("kind", ["global", "own generator", "persistent workers"])
def test_a_look_at_the_first_batch_leaves_the_loader_and_random_state_as_they_were(kind: str) -> None:
    """After :func:`first_batch`, every generator is where it was and a shuffling loader yields the
    batches, in the order, it would have yielded without the look (its own generator, and a
    loader that keeps its workers between epochs, too)."""
    from launcher.lightning.staging import first_batch

    data = TensorDataset(torch.arange(32))
    options = {"global": {}, "own generator": {"generator": torch.Generator().manual_seed(5)},
               "persistent workers": {"num_workers": 1, "persistent_workers": True}}[kind]

    def order(look: bool) -> tuple[list[list[int]], tuple]:
        L.seed_everything(3, verbose=False)
        if "generator" in options:
            options["generator"].manual_seed(5)
        loader = DataLoader(data, batch_size=4, shuffle=True, **options)
        if look:
            first = first_batch(loader)
            assert first[0].shape == (4,)
        before = _state()
        return [b[0].tolist() for b in loader], before

    want, state = order(look=False)
    got, state_after_look = order(look=True)
    assert got == want
    assert state_after_look[0] == state[0] and state_after_look[1] == state[1]
    assert torch.equal(state_after_look[2], state[2])


def test_a_traced_step_receives_the_batch_encoding_the_loader_made() -> None:
    """A ``transformers.BatchEncoding`` reaches a traced ``training_step`` as one (attribute access
    works), not as a dict or a tuple around it; tracing leaves the module in train mode."""
    from transformers import BatchEncoding

    seen: list[type] = []

    class Encoded(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(16, 8)
            self.head = torch.nn.Linear(8, 16)

        def training_step(self, batch, batch_idx):
            seen.append(type(batch))
            logits = self.head(self.embed(batch.input_ids))
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten())

    ids = torch.randint(0, 16, (4, 5))
    module = Encoded()
    staging = check_staging(module, 2, "auto", BatchEncoding({"input_ids": ids, "labels": ids}), 2)
    assert staging.traced and len(staging.model.stages) == 2
    assert seen and set(seen) == {BatchEncoding}
    # the trace's checks ran it in eval mode too: the module is back in train mode, the LightningModule itself
    # included (Lightning warns of a module in eval mode at the start of training, and keeps it so)
    assert [n for n, m in module.named_modules() if not m.training] == []


class Draws(torch.nn.Module):
    """Dropout, and a forward that draws from Python's and numpy's generators as well (changing nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.dropout = torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.linear(x)) * (1.0 + 0.0 * random.random() + 0.0 * float(np.random.rand()))


class Noisy(L.LightningModule):
    """Three :class:`Draws`, as ``self.stages`` (with ``self.loss``) for a profiled cut, or
    without them for a traced one."""

    def __init__(self, staged: bool) -> None:
        super().__init__()
        layers = [Draws() for _ in range(3)]
        self.stages = torch.nn.ModuleList(layers) if staged else None
        self.body = None if staged else torch.nn.Sequential(*layers)

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).mean()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss(self.body(x), y)


@pytest.mark.parametrize("partition", ["time", "params"])
def test_tracing_and_profiling_leave_the_random_state(partition: str) -> None:
    """The preflight's trace (a traced module, ``params``) and its profile of ``self.stages``
    (``time``) run the module, dropout included: every generator is where it was afterwards."""
    staged = partition == "time"
    model = Noisy(staged).double()
    batch = (torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64))
    L.seed_everything(4, verbose=False)
    before = _state()
    check_staging(model, 3, None if staged else "auto", batch, 2, partition=partition)
    after = _state()
    assert after[:2] == before[:2] and torch.equal(after[2], before[2])


def test_the_trainers_own_loaders_are_read_without_changing_its_order() -> None:
    """Where a worker finds its example (processes started outside, as by torchrun): the loaders the
    trainer will read, looked at while it sets up (as the strategy's ``setup`` does), leave the
    batches it then trains on, and their order, as they were."""
    from launcher.lightning.lightning_private import train_dataloaders
    from launcher.lightning.staging import first_batch

    class Seen(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer, self.seen = torch.nn.Linear(1, 1), []

        def training_step(self, batch, batch_idx):
            self.seen.append(batch[0].flatten().tolist())
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Look(L.Callback):
        def setup(self, trainer, pl_module, stage) -> None:
            self.first = first_batch(train_dataloaders(trainer))

    def seen(look: bool) -> list:
        L.seed_everything(0, verbose=False)
        model, callbacks = Seen(), [Look()] if look else []
        quiet_trainer(max_steps=4, callbacks=callbacks).fit(
            model, train_dataloaders=DataLoader(TensorDataset(torch.arange(16.0).unsqueeze(1)), batch_size=4,
                                                shuffle=True))
        if look:
            assert callbacks[0].first[0].flatten().tolist() == model.seen[0]  # the batch training began with
        return model.seen

    assert seen(look=True) == seen(look=False)
