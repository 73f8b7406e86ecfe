"""Models users bring that draw random numbers where a trace fixes things: recurrent layers with
dropout between their layers (``nn.LSTM``/``nn.GRU``/``nn.RNN``, traced to one ``aten.lstm``-like
op whose train flag the trace holds), and a diffusion model's training step, which draws its noise
(``torch.randn_like``) and timesteps (``torch.randint``) itself, around a ``diffusers.UNet2DModel``.

Both are traced and cut (``split=auto``) and train under several schemes to the parameters of
``strategy=single`` (:class:`~launcher.lightning.single.StreamedSingleDevice`: one device running
each step's micro-batches through the same random streams), float64, 3 steps, within 1e-10, at
the launcher's defaults: gradient clipping 1.0, the model's own dropout, ``DataLoader(shuffle=True)``
with ``drop_last=False`` (the data sets divide by the batch size, which a traced model needs).

Where the draws happen matters for the oracle: a training step draws its noise for the batch it is
given, so one device running the whole batch at once would draw other numbers than the micro-batches
do. Every scheme and ``strategy=single`` run the step once per micro-batch, each inside the job of
``(seed, step, micro-batch)``, whose stream seeds the step's head (the code before the network)
and each module's own draws: the same numbers for a micro-batch, whichever worker runs it.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from helpers.training import char_data, max_diff, quiet_trainer
from launcher.lightning import UnifiedStrategy
from launcher.lightning.single import StreamedSingleDevice

pytestmark = pytest.mark.timeout(600)

TOL = 1e-10
STEPS = 3
B = 4  # micro-batches, and stages
#: the gradient clipping a user of the launcher gets
CLIP = float(OmegaConf.load(Path(__file__).parents[2] / "conf" / "trainer" / "default.yaml").gradient_clip_val)


class RecurrentLM(L.LightningModule):
    """A character model around a two-layer recurrent layer with dropout 0.2 between its layers
    (four modules, so four stages)."""

    def __init__(self, kind: str = "LSTM") -> None:
        super().__init__()
        self.embed = nn.Embedding(128, 16)
        self.proj = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.rnn = getattr(nn, kind)(16, 16, num_layers=2, dropout=0.2, batch_first=True)
        self.head = nn.Linear(16, 128)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out, _ = self.rnn(self.proj(self.embed(x)))
        return nn.functional.cross_entropy(self.head(out).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Diffusion(L.LightningModule):
    """DDPM training as diffusers' examples write it: noise and timesteps drawn in the step, the
    UNet (random weights, 8 x 8 images, its own dropout 0.1) predicting the noise."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers import DDPMScheduler, UNet2DModel

        self.unet = UNet2DModel(sample_size=8, in_channels=1, out_channels=1, layers_per_block=1,
                                block_out_channels=(8, 16), down_block_types=("DownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4, dropout=0.1)
        self.noise_scheduler = DDPMScheduler(num_train_timesteps=100)

    def training_step(self, batch, batch_idx):
        clean = batch[0]
        noise = torch.randn_like(clean)
        steps = torch.randint(0, self.noise_scheduler.config.num_train_timesteps, (clean.shape[0],),
                              device=clean.device)
        noisy = self.noise_scheduler.add_noise(clean, noise, steps)
        return nn.functional.mse_loss(self.unet(noisy, steps).sample, noise)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def images() -> DataLoader:
    """64 random 8 x 8 images (their own generator), shuffled, in batches of 8."""
    data = torch.rand(64, 1, 8, 8, generator=torch.Generator().manual_seed(3)) * 2 - 1
    return DataLoader(TensorDataset(data), batch_size=8, shuffle=True)


MODELS = {
    "lstm": (lambda: RecurrentLM("LSTM"), lambda: {"datamodule": char_data()}),
    "gru": (lambda: RecurrentLM("GRU"), lambda: {"datamodule": char_data()}),
    "rnn": (lambda: RecurrentLM("RNN"), lambda: {"datamodule": char_data()}),
    "unet": (Diffusion, lambda: {"train_dataloaders": images()}),
}
SCHEMES = {"gpipe": {}, "lpp": {"G": 2, "R": 2}, "fsdp": {}}


def fit(name: str, strategy, devices: int) -> dict:
    build, data = MODELS[name]
    L.seed_everything(0, verbose=False)
    model = build()
    quiet_trainer(strategy, devices, precision="64-true", max_steps=STEPS, gradient_clip_val=CLIP).fit(model, **data())
    return model.state_dict()


@pytest.fixture(scope="module")
def single() -> dict:
    """``strategy=single``'s parameters for each model, trained once."""
    return {}


@pytest.mark.slow  # a forked run of 4 workers and a one-device run, each
@pytest.mark.parametrize("name, scheme", [("lstm", "gpipe"), ("gru", "lpp"), ("rnn", "fsdp"),
                                          ("unet", "gpipe"), ("unet", "lpp"), ("unet", "fsdp")])
def test_a_traced_model_that_draws_equals_strategy_single(name: str, scheme: str, single: dict) -> None:
    if name not in single:
        single[name] = fit(name, StreamedSingleDevice(microbatches=B, split="auto"), 1)
    got = fit(name, UnifiedStrategy(scheme, stages=B, microbatches=B, split="auto", **SCHEMES[scheme]), 4)
    diff = max_diff(single[name], got)
    print(f"{name}, {scheme}: parameters within {diff:.1e} of strategy=single")
    assert diff < TOL


def test_the_draws_matter() -> None:
    """The randomness is on: dropout and the step's noise change what one device trains to."""
    a = fit("unet", StreamedSingleDevice(microbatches=B, split="auto", seed=1), 1)
    b = fit("unet", StreamedSingleDevice(microbatches=B, split="auto", seed=2), 1)
    assert max_diff(a, b) > 1e-6
