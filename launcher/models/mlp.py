"""A character MLP on the same data as the GPT: each position predicts the next character from
its own embedding, through ``n_layer`` GELU layers. ``stages = [Embedding, Layer x n_layer, Head]``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..torch_support.checks import non_negative_ints, positive_ints, positive_number
from .base import StagedLM


class Layer(nn.Module):
    """``x + gelu(x W + b)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.lin(x))


class CharMLP(StagedLM):
    """Bigram-style MLP language model; SGD with momentum."""

    def __init__(self, vocab_size: int = 128, width: int = 128, n_layer: int = 6, lr: float = 0.5) -> None:
        super().__init__()
        positive_ints(vocab_size=vocab_size, width=width)
        non_negative_ints(n_layer=n_layer)
        positive_number("lr", lr, "the learning rate")
        self.save_hyperparameters()
        self.stages = nn.ModuleList([nn.Embedding(vocab_size, width), *(Layer(width) for _ in range(n_layer)),
                                     nn.Linear(width, vocab_size)])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=0.9)
