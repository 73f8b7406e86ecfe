"""A character MLP on the same data as the GPT: each position predicts the next character from
its own embedding, through ``n_layer`` GELU layers. ``stages = [Embedding, Layer x n_layer, Head]``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn


class Layer(nn.Module):
    """``x + gelu(x W + b)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.lin(x))


class CharMLP(LightningModule):
    """Bigram-style MLP language model; SGD with momentum."""

    def __init__(self, vocab_size: int = 128, width: int = 128, n_layer: int = 6, lr: float = 0.5) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.stages = nn.ModuleList([nn.Embedding(vocab_size, width), *(Layer(width) for _ in range(n_layer)),
                                     nn.Linear(width, vocab_size)])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx
        for stage in self.stages:
            x = stage(x)
        return x

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss(self(x), y)
        self.log("val_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
