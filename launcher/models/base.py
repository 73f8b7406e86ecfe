"""What the built-in language models share: a chain of ``self.stages`` applied in order, the
cross-entropy loss over every position, and the ordinary single-device steps."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule


class StagedLM(LightningModule):
    """A LightningModule whose layers are ``self.stages`` (set by the subclass), in order."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx
        for stage in self.stages:
            x = stage(x)
        return x

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    def _step(self, batch: tuple[torch.Tensor, torch.Tensor], key: str, prog_bar: bool) -> torch.Tensor:
        x, y = batch
        loss = self.loss(self(x), y)
        self.log(key, loss, prog_bar=prog_bar)
        return loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train_loss", True)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "val_loss", True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "test_loss", False)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])
