"""All-reduce over point-to-point messages: recursive halving and doubling (Rabenseifner), and
through one root for small buffers.

Among ``n`` workers, a reduce-scatter by recursive halving (each round, partners ``i`` and
``i xor d`` swap halves of their current range and keep the sum of one half) followed by an
all-gather by recursive doubling (the same rounds backwards). Each worker sends and receives
``2 (n - 1) / n`` of the buffer, as a ring does (bandwidth-optimal), but in ``2 log2(n)`` rounds
instead of ``2 (n - 1)``. When ``n`` is not a power of two, the first ``2r`` workers
(``r = n - p``, ``p`` the largest power of two below ``n``) pair up first: the odd one hands its
buffer to the even one, which takes its place, and gets the result back at the end.

Why not ``torch.distributed.all_reduce`` on gloo: gloo's ring takes ``2 (n - 1)`` rounds, and on
workers that share cores each round waits for a peer to be scheduled. Measured alone (2 cores,
``benchmarks/vs_torch_native.py`` and the notes of issue 8): 264 KB among 4 workers, gloo 5-7 ms,
halving-doubling 2.7 ms, through a root 1.4 ms; among 8, 20, 10 and 3.6 ms; 4 MB among 8: gloo
25 ms, halving-doubling 19 ms, through a root 25 ms. Both algorithms leave every worker with the
same bits (each sum is computed once and copied, or adds the same terms in a commuted order).
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


def halving_doubling(
    flat: torch.Tensor,
    ranks: Sequence[int],
    me: int,
    tag: Callable[[int], int],
    group: dist.ProcessGroup | None = None,
    clock: Any = None,
    scratch: torch.Tensor | None = None,
) -> None:
    """Sum ``flat`` (1-D, contiguous) in place across ``ranks`` (ranks of ``group``; ``ranks[me]``
    is this process). Round ``k``'s messages carry tag ``tag(k)``, so concurrent reductions and
    other messages between the same ranks never match each other's. ``clock`` (a
    :class:`~launcher.runtime.comm.Clock`) times the messages; ``scratch`` (at least ``flat``'s
    size, reused from step to step) receives the peers' halves, so a step allocates nothing."""
    n = len(ranks)
    if n < 2:
        return
    io = _Messages(ranks, me, group, clock)
    p = 1 << (n.bit_length() - 1)
    r = n - p
    round_ = 2
    if scratch is None:
        scratch = torch.empty_like(flat)

    def exchange(peer: int, send: torch.Tensor, recv: torch.Tensor) -> None:
        nonlocal round_
        t = tag(round_)
        round_ += 1
        # the receive first: the peer's data never waits for a buffer to land in
        incoming = io.recv(recv, peer, t)
        outgoing = io.send(send, peer, t)
        io.wait(incoming, peer, t)
        outgoing.wait()

    # fold: of the first 2r workers the odd ones hand their buffer to their even neighbour
    if me < 2 * r:
        if me % 2:
            io.send(flat, me - 1, tag(0)).wait()
            io.wait(io.recv(flat, me - 1, tag(1)), me - 1, tag(1))
            return
        buf = scratch[: flat.numel()]
        io.wait(io.recv(buf, me + 1, tag(0)), me + 1, tag(0))
        flat += buf
    v = me // 2 if me < 2 * r else me - r  # this worker's place among the p that remain

    def real(u: int) -> int:
        return 2 * u if u < r else u + r

    lo, hi = 0, flat.numel()
    steps: list[tuple[int, int, int, int, int]] = []  # (peer, kept lo, kept hi, given lo, given hi)
    d = p // 2
    while d >= 1:
        peer = v ^ d
        mid = (lo + hi) // 2
        (klo, khi), (glo, ghi) = ((mid, hi), (lo, mid)) if v & d else ((lo, mid), (mid, hi))
        buf = scratch[: khi - klo]
        exchange(real(peer), flat[glo:ghi], buf)
        flat[klo:khi] += buf
        steps.append((real(peer), klo, khi, glo, ghi))
        lo, hi = klo, khi
        d //= 2
    for peer, klo, khi, glo, ghi in reversed(steps):
        exchange(peer, flat[klo:khi], flat[glo:ghi])
    if me < 2 * r:  # hand the result back to the odd neighbour
        io.send(flat, me + 1, tag(1)).wait()


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
