"""What every stage returns and every edge carries for one micro-batch's input shapes: the
signatures the engine packs, sends and unpacks values by."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..torch_support.staged import StagedModel
from ..torch_support.values import Signature, item_leaves, pick


@dataclass
class Edge:
    """What one edge ``p -> c`` carries for one micro-batch shape: the value's signature, and
    where each of its differentiable leaves sits among the leaves of ``p``'s whole output."""

    sig: Signature
    out_index: list[int]


class Shapes:
    """Signatures of every stage's output and every edge's value, for one micro-batch's shapes."""

    def __init__(self, model: StagedModel, outs: list[Signature], metas: list[Any],
                 compute_dtype: torch.dtype | None = None) -> None:
        self.out = outs
        self.edges: dict[tuple[int, int], Edge] = {}
        # mixed precision: every floating leaf crosses between stages in the compute dtype
        for c, preds in enumerate(model.graph.preds):
            for p in preds:
                items = model.edge(p, c)
                if items is None:
                    self.edges[(p, c)] = Edge(outs[p].cast(compute_dtype), list(outs[p].grads))
                    continue
                ranges = item_leaves(metas[p])
                where = [k for i in items for k in ranges[i]]
                sig = Signature.of(pick(metas[p], items))
                self.edges[(p, c)] = Edge(sig.cast(compute_dtype), [where[j] for j in sig.grads])

    def input_bytes(self, s: int, preds: tuple[int, ...]) -> int:
        return sum(self.edges[(p, s)].sig.nbytes() for p in preds)


def shape_key(x: Any) -> Any:
    """What a micro-batch's input shapes are keyed by (a tensor's shape and dtype, cheaply)."""
    return (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else Signature.of(x)


def leaves_key(values: Sequence[Any]) -> tuple:
    """:func:`shape_key` of each value, with a tensor's ``requires_grad``."""
    return tuple((shape_key(v), v.requires_grad) if isinstance(v, torch.Tensor) else shape_key(v) for v in values)
