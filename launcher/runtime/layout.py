"""Where a stage's parameters sit in one flat buffer: the form weights and gradients travel in.

The trainable parameters (``requires_grad``) come first and the frozen ones after them, so a
stage's gradient is the buffer's prefix of :attr:`StageLayout.grad_numel` elements: a fetched copy
is one message and one buffer, but only its trainable prefix is a leaf autograd differentiates,
and gradient sums, replica all-reduces and optimizer state cover that prefix alone (a LoRA step
moves adapter gradients only). Frozen parameters are those of the module when the layout is made
(the engine's set-up): a parameter that changes ``requires_grad`` later keeps its place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn


@dataclass
class StageLayout:
    """Names, shapes and offsets of one stage's parameters inside a flat buffer, in buffer order:
    the first :attr:`trainable` take a gradient, the rest are frozen. :attr:`index` maps a
    parameter's position in ``module.parameters()`` to its place in the buffer."""

    names: list[str]
    shapes: list[torch.Size]
    numels: list[int]
    dtype: torch.dtype
    trainable: int = -1  # -1: all of them
    index: list[int] = field(default_factory=list)  # module order -> buffer order (empty: the same)
    numel: int = field(init=False)
    grad_numel: int = field(init=False)  # the trainable prefix: what a gradient holds
    offsets: list[int] = field(init=False)

    def __post_init__(self) -> None:
        if self.trainable < 0:
            self.trainable = len(self.names)
        if not self.index:
            self.index = list(range(len(self.names)))
        self.numel = sum(self.numels)
        self.grad_numel = sum(self.numels[: self.trainable])
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]

    @classmethod
    def of(cls, module: nn.Module) -> StageLayout:
        named = list(module.named_parameters())
        dtype = named[0][1].dtype if named else torch.float32
        order = ([i for i, (_, p) in enumerate(named) if p.requires_grad]
                 + [i for i, (_, p) in enumerate(named) if not p.requires_grad])
        index = [0] * len(order)
        for at, i in enumerate(order):
            index[i] = at
        ps = [named[i] for i in order]
        return cls([n for n, _ in ps], [p.shape for _, p in ps], [p.numel() for _, p in ps], dtype,
                   sum(p.requires_grad for _, p in named), index)

    @property
    def frozen(self) -> bool:
        """Whether some parameter of the stage takes no gradient."""
        return self.trainable < len(self.names)

    def ordered(self, module: nn.Module, trainable_only: bool = False) -> list[torch.Tensor]:
        """``module``'s parameters in buffer order (only the trainable ones: the gradient's order)."""
        ps: list[torch.Tensor] = list(module.parameters())
        out = [ps[i] for i in sorted(range(len(ps)), key=self.index.__getitem__)]
        return out[: self.trainable] if trainable_only else out

    def pack_module(self, module: nn.Module) -> torch.Tensor:
        """``module``'s parameter values, detached, as one flat buffer."""
        return self.pack([p.detach() for p in self.ordered(module)])

    def views(self, flat: torch.Tensor, grad: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Parameters as views into ``flat`` (so autograd through them lands in ``flat.grad``); with
        ``grad`` (a leaf of :attr:`grad_numel` elements), the trainable ones are views into it and the
        frozen ones into the rest of ``flat``."""
        if grad is None:
            return {n: t.view(shape) for n, t, shape in zip(self.names, flat.split(self.numels), self.shapes)}
        k = self.trainable
        parts = [*grad.split(self.numels[:k]), *flat[self.grad_numel:].split(self.numels[k:])]
        return {n: t.view(shape) for n, t, shape in zip(self.names, parts, self.shapes)}

    def grad_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each trainable parameter's view of a gradient buffer (:attr:`grad_numel` elements)."""
        k = self.trainable
        return [t.view(shape) for t, shape in zip(flat.split(self.numels[:k]), self.shapes[:k])]

    def param_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i`` (in ``module.parameters()`` order) as a view of a full buffer or, when it
        is trainable, of a gradient buffer."""
        at = self.index[i]
        return flat[self.offsets[at]: self.offsets[at] + self.numels[at]].view(self.shapes[at])

    def is_trainable(self, i: int) -> bool:
        """Whether parameter ``i`` (in ``module.parameters()`` order) takes a gradient."""
        return self.index[i] < self.trainable

    def pack(self, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensors in buffer order (or its trainable prefix) as one flat buffer."""
        if not tensors:
            return torch.zeros(0, dtype=self.dtype) if out is None else out
        return (torch.cat([t.reshape(-1) for t in tensors], out=out) if out is not None
                else torch.cat([t.reshape(-1) for t in tensors]))
