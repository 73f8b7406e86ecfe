"""BatchNorm running statistics under any schedule, exactly as one process running the step's
micro-batches in order.

In training mode a BatchNorm layer normalises with each micro-batch's own statistics (so its
outputs, and every gradient, do not depend on the running statistics) and updates them in place:
``r <- a_b * r + f_b * m_b`` with ``f_b`` its momentum (or ``1 / n`` for a cumulative average,
``n`` counting the batches seen) and ``a_b = 1 - f_b``. Run in order over the step's micro-batches
``0 .. B-1`` from ``r0``, that gives ``r_B = (a_0 ... a_{B-1}) r0 + sum_b (a_{b+1} ... a_{B-1}) c_b``
with ``c_b = f_b * m_b``, a sum over micro-batches, which can be computed wherever they run.

So every forward of a training step starts its layers from the step's ``r0`` (and the batch
count micro-batch ``b`` would see), reads ``c_b = r' - a_b r0`` off the updated buffers, and adds
it, weighted, into a per-stage sum; at the end of the step one all-reduce over the workers adds the
sums, and every worker sets every copy of the stage's statistics to ``r_B``. Every worker thus
holds the same statistics for every stage (they are small), which evaluation in eval mode uses.
A forward that only recomputes (activation checkpointing) adds nothing.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..torch_support.torch_private import BatchNormBase


def tracked(module: nn.Module) -> list[BatchNormBase]:
    """``module``'s BatchNorm layers that keep running statistics, in module order."""
    return [m for m in module.modules() if isinstance(m, BatchNormBase) and m.track_running_stats
            and m.running_mean is not None]


def _running(bn: BatchNormBase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``bn``'s running mean, variance and batch count (a :func:`tracked` layer has all three)."""
    mean, var, count = bn.running_mean, bn.running_var, bn.num_batches_tracked
    assert mean is not None and var is not None and count is not None
    return mean, var, count


def _set(bn: BatchNormBase, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
    """Give ``bn`` new statistics tensors. New ones, not an in-place copy: a forward's autograd
    graph holds the tensors it ran with and checks that they were not changed since."""
    bn.running_mean = mean
    bn.running_var = var
    bn.num_batches_tracked = torch.tensor(count, dtype=torch.long, device=mean.device)


class RunningStats:
    """The running statistics of every stage on this worker and their exact update."""

    def __init__(self, holders: Sequence[Sequence[nn.Module]], microbatches: int) -> None:
        # stage -> every module object that computes it here (the owned one, the skeleton), each
        # with its BatchNorm layers in the same order (the skeleton is a copy)
        self.modules = [list(hs) for hs in holders]
        self.layers = [[tracked(m) for m in hs] for hs in holders]
        self.microbatches = microbatches
        self.n = microbatches  # the step's micro-batches that count: the first n (the rest stand in)
        self.on = any(ls and ls[0] for ls in self.layers)
        self.r0: dict[int, list[tuple[torch.Tensor, torch.Tensor, int]]] = {}
        self.sums: dict[int, list[list[torch.Tensor]]] = {}

    def _factor(self, bn: BatchNormBase, n0: int, b: int) -> float:
        return bn.momentum if bn.momentum is not None else 1.0 / (n0 + b + 1)

    def begin(self, counted: int | None = None) -> None:
        """The step's starting statistics, and empty sums; ``counted``: the step's first micro-batches
        that update the statistics (default all ``B``; the others stand in for missing samples)."""
        self.n = self.microbatches if counted is None else counted
        if not self.on:
            return
        self.r0, self.sums = {}, {}
        for s, holders in enumerate(self.layers):
            if holders and holders[0]:
                self.r0[s] = [(mean.clone(), var.clone(), int(count)) for mean, var, count in map(_running, holders[0])]
                self.sums[s] = [[torch.zeros_like(m), torch.zeros_like(v)] for m, v, _ in self.r0[s]]

    def _layers_of(self, s: int, module: nn.Module) -> list[BatchNormBase]:
        for m, layers in zip(self.modules[s], self.layers[s]):
            if m is module:
                return layers
        raise KeyError(f"stage {s} is computed by a module the running statistics do not know")

    def before(self, s: int, b: int, module: nn.Module) -> None:
        """Start ``module``'s layers of stage ``s`` from the step's statistics, as micro-batch ``b``."""
        if s not in self.r0:
            return
        for bn, (m0, v0, n0) in zip(self._layers_of(s, module), self.r0[s]):
            _set(bn, m0.clone(), v0.clone(), n0 + b)

    def after(self, s: int, b: int, module: nn.Module, count: bool = True) -> None:
        """Add micro-batch ``b``'s contribution (``count``), and put the step's statistics back."""
        if s not in self.r0:
            return
        count = count and b < self.n
        with torch.no_grad():
            for bn, (m0, v0, n0), acc in zip(self._layers_of(s, module), self.r0[s], self.sums[s]):
                if count:
                    f = self._factor(bn, n0, b)
                    w = 1.0
                    for k in range(b + 1, self.n):
                        w *= 1.0 - self._factor(bn, n0, k)
                    mean, var, _ = _running(bn)
                    acc[0].add_(mean - (1.0 - f) * m0, alpha=w)
                    acc[1].add_(var - (1.0 - f) * v0, alpha=w)
                _set(bn, m0.clone(), v0.clone(), n0)

    def end(self, group: dist.ProcessGroup | None, device: torch.device, workers: int) -> None:
        """Add every worker's sums (a collective over the group) and set every copy to ``r_B``."""
        if not self.on:
            return
        parts = [t for s in sorted(self.sums) for pair in self.sums[s] for t in pair]
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in parts]).to(device)
        if workers > 1:
            dist.all_reduce(flat, group=group)
        flat = flat.cpu() if device.type != "cpu" else flat
        at = 0
        with torch.no_grad():
            for s in sorted(self.sums):
                for k, ((m0, v0, n0), bn0) in enumerate(zip(self.r0[s], self.layers[s][0])):
                    keep = 1.0
                    for b in range(self.n):
                        keep *= 1.0 - self._factor(bn0, n0, b)
                    new = []
                    for t0 in (m0, v0):
                        n = t0.numel()
                        new.append((keep * t0.to(torch.float64).cpu() + flat[at : at + n].view(t0.shape)).to(t0.dtype))
                        at += n
                    for holder in self.layers[s]:
                        _set(holder[k], new[0].to(m0.device), new[1].to(v0.device), n0 + self.n)
