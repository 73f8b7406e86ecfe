"""A ``timm`` image classifier cut into stages made of the model's own submodules, and a small
synthetic image set that needs no download.

For a timm ResNet (``resnet10t``, ``resnet18``, ``resnet50d``, ``seresnext26t_32x4d``, ...)
``stages = [stem, layer1, layer2, layer3, layer4, head]``: the stem is the model's ``conv1``,
``bn1``, ``act1`` and ``maxpool``; the head its ``global_pool``, dropout and ``fc`` (what its
``forward_head`` does). Each stage takes the previous one's tensor and returns a tensor; the head
returns the logits. BatchNorm running statistics are buffers inside the stages.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import TensorDataset

from .base import adamw_cosine
from .data import SeededData


def _timm() -> Any:
    """timm, imported on first use: the models extra is optional."""
    try:
        import timm
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(f"model=timm needs timm: pip install -e '.[models]' ({error})") from error
    return timm


class Stem(nn.Module):
    """A ResNet's stem: ``conv1``, ``bn1``, ``act1``, ``maxpool``, as its ``forward_features`` runs them."""

    def __init__(self, conv1: nn.Module, bn1: nn.Module, act1: nn.Module, maxpool: nn.Module) -> None:
        super().__init__()
        self.conv1, self.bn1, self.act1, self.maxpool = conv1, bn1, act1, maxpool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.maxpool(self.act1(self.bn1(self.conv1(x))))


class Head(nn.Module):
    """A ResNet's ``forward_head``: global pool, dropout (``drop_rate``), ``fc``. The dropout follows
    this module's own train/eval mode, so the stage needs nothing of the whole model."""

    def __init__(self, global_pool: nn.Module, fc: nn.Module, drop_rate: float) -> None:
        super().__init__()
        self.global_pool, self.fc, self.drop_rate = global_pool, fc, float(drop_rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.global_pool(x)
        if self.drop_rate:
            x = F.dropout(x, p=self.drop_rate, training=self.training)
        return self.fc(x)


def cut(model: nn.Module, name: str) -> list[nn.Module]:
    """The stages of a timm model, made of its own modules (no copies)."""
    from timm.models.resnet import ResNet

    if not isinstance(model, ResNet):
        raise ValueError(f"model.name={name} is a timm {type(model).__name__}; only timm ResNets (resnet*, "
                         f"resnext*, seresnet*, ...) can be cut into stages so far.")
    return [Stem(model.conv1, model.bn1, model.act1, model.maxpool), model.layer1, model.layer2, model.layer3,
            model.layer4, Head(model.global_pool, model.fc, model.drop_rate)]


class TimmClassifier(LightningModule):
    """A timm image classifier (``name``, random weights, ``num_classes`` outputs) as ``self.stages``.

    The timm model stays whole as ``self.net``: its own ``forward`` is the single-device path, the
    oracle the stages must match. It is kept out of the module tree, so every parameter and buffer
    is named once, under ``stages.``, and ``.to()`` on this module reaches all of them. Batches are
    ``(images [N, C, H, W], labels [N])``; the loss is cross-entropy, the mean over the batch.
    AdamW with a cosine learning-rate schedule over ``max_steps``, like :class:`GPT`.
    """

    def __init__(self, name: str = "resnet10t", num_classes: int = 10, in_chans: int = 3, drop_rate: float = 0.0,
                 lr: float = 3e-3, weight_decay: float = 0.0, max_steps: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        model = _timm().create_model(name, pretrained=False, num_classes=num_classes, in_chans=in_chans,
                                     drop_rate=drop_rate)
        # a plain attribute, not a child module: its parameters are named once, under stages
        object.__setattr__(self, "net", model)
        self.stages = nn.ModuleList(cut(model, name))
        held = {id(t) for t in self.stages.state_dict(keep_vars=True).values()}
        missed = [k for k, t in model.state_dict(keep_vars=True).items() if id(t) not in held]
        if missed:  # the model has state outside the modules its forward runs through the stages
            raise ValueError(f"model.name={name}: {missed[0]} of the timm model is in no stage")

    def train(self, mode: bool = True) -> TimmClassifier:
        super().train(mode)
        self.net.train(mode)  # the model object itself, which the stages do not hold
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The logits from the timm model's own forward."""
        return self.net(x)

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, target)

    def _step(self, batch: tuple[torch.Tensor, torch.Tensor], key: str, prog_bar: bool) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = self.loss(logits, y)
        self.log(f"{key}_loss", loss, prog_bar=prog_bar, batch_size=y.shape[0])
        self.log(f"{key}_acc", (logits.argmax(-1) == y).float().mean(), batch_size=y.shape[0])
        return loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train", True)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "val", True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "test", False)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self):  # noqa: ANN201 - Lightning's union of return types
        return adamw_cosine(self.parameters(), self.hparams.lr, self.hparams.weight_decay, self.hparams.max_steps)


def shapes(n: int, size: int, num_classes: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` noisy striped images ``[n, 3, size, size]`` (float32) and their labels ``[n]``.

    Class ``k`` is a grating at angle ``180 k / num_classes`` degrees, of one of two stripe
    widths (by the parity of ``k``); the phase, the colours of the two stripe shades, the
    contrast and the noise are drawn per image, so only the orientation and width tell the class.
    """
    labels = torch.randperm(n, generator=generator) % num_classes
    angle = math.pi * labels.double() / num_classes
    period = torch.where(labels % 2 == 0, 0.25, 0.45) * size  # pixels per stripe pair
    phase = 2 * math.pi * torch.rand(n, generator=generator, dtype=torch.float64)
    grid = torch.arange(size, dtype=torch.float64)
    ys, xs = grid[:, None], grid[None, :]
    along = xs[None] * angle.cos()[:, None, None] + ys[None] * angle.sin()[:, None, None]
    wave = torch.sin(2 * math.pi * along / period[:, None, None] + phase[:, None, None])  # [n, size, size]
    light, dark = (torch.rand(n, 3, 1, 1, generator=generator, dtype=torch.float64) for _ in range(2))
    contrast = 0.5 + 0.5 * torch.rand(n, 1, 1, 1, generator=generator, dtype=torch.float64)
    mix = 0.5 + 0.5 * contrast * wave[:, None]
    images = mix * light + (1 - mix) * dark
    images = images + 0.2 * torch.randn(n, 3, size, size, generator=generator, dtype=torch.float64)
    return ((images - 0.5) / 0.5).float(), labels.long()


class ShapesImages(SeededData):
    """Image classification without a download: :func:`shapes`' striped images, ``n`` in all
    (the first ``val_fraction`` of them for validation), drawn once from ``seed``; shuffled and
    resumed as :class:`~launcher.models.data.SeededData` says."""

    def __init__(self, batch_size: int = 32, size: int = 32, n: int = 4096, num_classes: int = 10,
                 val_fraction: float = 0.125, shuffle: bool = True, seed: int = 0) -> None:
        super().__init__(batch_size, shuffle, seed)
        self.size, self.n, self.num_classes, self.val_fraction = size, n, num_classes, val_fraction

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        x, y = shapes(self.n, self.size, self.num_classes, torch.Generator().manual_seed(self.seed))
        n_val = max(1, int(self.n * self.val_fraction))
        self.train_set = TensorDataset(x[n_val:], y[n_val:])
        self.val_set = TensorDataset(x[:n_val], y[:n_val])
