"""Where a stage's parameters sit in one flat buffer: the form weights and gradients travel in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn


@dataclass
class StageLayout:
    """Names, shapes and offsets of one stage's parameters inside a flat buffer."""

    names: list[str]
    shapes: list[torch.Size]
    numels: list[int]
    dtype: torch.dtype
    numel: int = field(init=False)

    def __post_init__(self) -> None:
        self.numel = sum(self.numels)

    @classmethod
    def of(cls, module: nn.Module) -> "StageLayout":
        named = list(module.named_parameters())
        dtype = named[0][1].dtype if named else torch.float32
        return cls([n for n, _ in named], [p.shape for _, p in named], [p.numel() for _, p in named], dtype)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameters as views into ``flat`` (so autograd through them lands in ``flat.grad``)."""
        return {n: t.view(shape) for n, t, shape in zip(self.names, flat.split(self.numels), self.shapes)}

    def pack(self, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        if not tensors:
            return torch.zeros(0, dtype=self.dtype) if out is None else out
        return (torch.cat([t.reshape(-1) for t in tensors], out=out) if out is not None
                else torch.cat([t.reshape(-1) for t in tensors]))
