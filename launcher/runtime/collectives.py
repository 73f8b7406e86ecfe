"""All-reduce over point-to-point messages through one root, for small buffers.

Every member sends its buffer to the first, which adds them in rank order and sends the total
back: two rounds, where gloo's ring takes ``2 (n - 1)``. On workers that share cores each round
waits for a peer to be scheduled, so for a small buffer (the root moves ``(n - 1)`` times it each
way) the rounds are the cost. Measured alone (2 cores, ``benchmarks/vs_torch_native.py`` and the
notes of issue 8): 264 KB among 4 workers, gloo 5-7 ms, through a root 1.4 ms; among 8, 20 and
3.6 ms. Every member ends with the same bits (each sum is computed once and copied). A large
buffer goes to gloo's own ring (:mod:`launcher.runtime.groups`): it used to be reduced here by
recursive halving-doubling, on the compute thread, which cost that thread what DDP's ring costs
gloo's threads (docs/performance.md, "Collectives per step").
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .comm import irecv, isend


class _Messages:
    """Point-to-point messages of one all-reduce, timed for :class:`~launcher.runtime.comm.Clock`
    (a message is keyed by its tag and sender, the same at both ends)."""

    def __init__(self, ranks: Sequence[int], me: int, group: dist.ProcessGroup | None, clock: Any) -> None:
        self.ranks, self.me, self.group, self.clock = ranks, me, group, clock

    def send(self, t: torch.Tensor, peer: int, tag: int) -> dist.Work:
        if self.clock is not None:
            self.clock.sent((tag, self.ranks[self.me]))
        return isend(t, self.ranks[peer], group=self.group, tag=tag)

    def recv(self, t: torch.Tensor, peer: int, tag: int) -> dist.Work:
        work = irecv(t, self.ranks[peer], group=self.group, tag=tag)
        if self.clock is not None:
            self.clock.posted((tag, self.ranks[peer]))
        return work

    def wait(self, work: dist.Work, peer: int, tag: int) -> None:
        t0 = time.perf_counter()
        work.wait()
        if self.clock is not None:
            t1 = time.perf_counter()
            self.clock.arrived((tag, self.ranks[peer]), t1, t1 - t0, exchange=True)


def through_root(
    flat: torch.Tensor,
    ranks: Sequence[int],
    me: int,
    tag: Callable[[int], int],
    group: dist.ProcessGroup | None = None,
    clock: Any = None,
    scratch: torch.Tensor | None = None,
) -> None:
    """Sum ``flat`` in place across ``ranks`` in two rounds: every worker sends it to ``ranks[0]``,
    which adds them and sends the total back. The root moves ``(n - 1)`` buffers each way, so this
    is for small buffers, where a round's latency costs more than that volume. ``scratch``: at
    least ``(n - 1)`` times ``flat``'s size, for the root's receives."""
    n = len(ranks)
    if n < 2:
        return
    io = _Messages(ranks, me, group, clock)
    if me:
        io.send(flat, 0, tag(0)).wait()
        io.wait(io.recv(flat, 0, tag(1)), 0, tag(1))
        return
    if scratch is None:
        scratch = torch.empty((n - 1) * flat.numel(), dtype=flat.dtype, device=flat.device)
    bufs = scratch[: (n - 1) * flat.numel()].view(n - 1, -1).unbind(0) if flat.numel() else [flat] * (n - 1)
    works = [io.recv(b, k + 1, tag(0)) for k, b in enumerate(bufs)]
    for k, (work, b) in enumerate(zip(works, bufs)):  # in rank order, so every run adds in the same order
        io.wait(work, k + 1, tag(0))
        flat += b
    for work in [io.send(flat, k + 1, tag(1)) for k in range(n - 1)]:
        work.wait()
