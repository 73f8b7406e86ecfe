"""Two LightningModules as users bring them, for the "models tried" table (benchmarks/real_models.py
runs them with ``PYTHONPATH=benchmarks``): neither has ``self.stages``, so each is traced and cut.

    python -m launcher model=custom model._target_=user_models.RecurrentLM model.kind=GRU split=auto
    python -m launcher model=custom model._target_=user_models.Diffusion data=images data.size=16 split=auto

The same modules are trained against ``strategy=single`` in tests/lightning/test_user_models.py.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn


class RecurrentLM(L.LightningModule):
    """A character model around a two-layer ``nn.LSTM`` (or ``GRU``, ``RNN``: ``kind``) with
    dropout between its layers."""

    def __init__(self, kind: str = "LSTM", width: int = 64, dropout: float = 0.2) -> None:
        super().__init__()
        self.embed = nn.Embedding(128, width)
        self.proj = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        self.rnn = getattr(nn, kind)(width, width, num_layers=2, dropout=dropout, batch_first=True)
        self.head = nn.Linear(width, 128)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out, _ = self.rnn(self.proj(self.embed(x)))
        return nn.functional.cross_entropy(self.head(out).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Diffusion(L.LightningModule):
    """DDPM training as diffusers' examples write it: noise and timesteps drawn in the step, a
    ``diffusers.UNet2DModel`` (random weights, its dropout) predicting the noise."""

    def __init__(self, size: int = 16, channels: int = 3, width: int = 16) -> None:
        super().__init__()
        from diffusers import DDPMScheduler, UNet2DModel

        self.unet = UNet2DModel(sample_size=size, in_channels=channels, out_channels=channels, layers_per_block=1,
                                block_out_channels=(width, 2 * width), down_block_types=("DownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=width // 2, dropout=0.1)
        self.noise_scheduler = DDPMScheduler(num_train_timesteps=1000)

    def training_step(self, batch, batch_idx):
        clean = batch[0]
        noise = torch.randn_like(clean)
        steps = torch.randint(0, self.noise_scheduler.config.num_train_timesteps, (clean.shape[0],),
                              device=clean.device)
        noisy = self.noise_scheduler.add_noise(clean, noise, steps)
        return nn.functional.mse_loss(self.unet(noisy, steps).sample, noise)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
