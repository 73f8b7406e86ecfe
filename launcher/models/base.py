"""What the built-in language models share: a chain of ``self.stages`` applied in order, the
cross-entropy loss over every position, the ordinary single-device steps, and the optimizer."""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule

from ..torch_support.init import default_reset


def adamw_cosine(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float, max_steps: int) -> Any:
    """AdamW; with ``max_steps`` > 0, a cosine learning-rate schedule from ``lr`` down to ``lr / 10``
    at ``max_steps`` (then ``lr / 10``), stepped every optimizer step. What ``configure_optimizers``
    returns. ``max_steps`` is a hyperparameter, so the checkpoint keeps the schedule's length and a
    resume keeps it (:mod:`launcher.lightning.resume`), whatever ``trainer.max_steps`` it runs to."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if not max_steps or max_steps < 0:  # 0, or -1 (trainer.max_steps=-1: epochs): a constant rate
        return opt
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(i, max_steps) / max_steps)))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class StagedLM(LightningModule):
    """A LightningModule whose layers are ``self.stages`` (set by the subclass), in order."""

    stages: torch.nn.ModuleList

    def reset_stage(self, module: torch.nn.Module) -> None:
        """Initialise one module of ``self.stages`` as its layers' constructors do (the rule a
        model built on the meta device follows, :mod:`launcher.torch_support.init`)."""
        default_reset(module)

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
