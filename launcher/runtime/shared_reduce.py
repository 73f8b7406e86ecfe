"""The replicas' gradient all-reduce through shared memory, between workers on one host's CPUs.

Over gloo an all-reduce of W workers on one host pushes about ``2 (W - 1) / W`` times the gradient's
bytes through loopback sockets per worker (gloo's ring), costing kernel copies and gloo's threads
CPU on cores the workers share. Here each owner of a bucket (:class:`~launcher.runtime.groups.Bucket`)
keeps the bucket's buffer, where its gradient accumulates (:class:`~launcher.runtime.groups.Replicas`),
in an anonymous memory file it hands to the bucket's other owners over their links
(:class:`~launcher.runtime.shared_links.SharedLinks`, an ``AREA`` notice), followed by a result
area for its own chunk. The bucket is cut into one chunk per owner, and reduced by a
reduce-scatter then an all-gather through the shared buffers:

1. share: once its share is complete (where gloo's all-reduce would be launched,
   :meth:`~launcher.runtime.groups.Replicas.launch_ready`) an owner says so to the others (``SHARE``);
2. sum: once every owner's share is complete, owner ``i`` adds chunk ``i`` of every owner's buffer,
   in owner order (0, 1, ...), into its result area, and says so (``SUMMED``);
3. gather: once every owner's chunk is summed, each owner copies every owner's result area into
   its own buffer. Every owner ends with the same bits: each chunk is summed once, by one owner (in
   the order through a root adds, :func:`~launcher.runtime.collectives.through_root`).

Why no buffer is overwritten before every peer has read it, step after step:

- owner ``j``'s buffer is read by the other owners in their sums (2) of step ``t``. Owner ``j``
  writes it again in its own gather (3) and in the backward of step ``t + 1``, both after every
  owner's ``SUMMED`` of step ``t``, which each sends only once it has read its chunk of every buffer.
- owner ``i``'s result area is read by every owner in its gather (3) of step ``t``. Owner ``i``
  writes it again only in its sum (2) of step ``t + 1``, after every owner's ``SHARE`` of step
  ``t + 1``, which each sends only after its step ``t`` ended, its gather included.
- so a bucket's notice of step ``t + 1`` never comes before the same notice of step ``t`` was
  taken, and a set of bucket indices per peer is all the state the notices need.

Waits select on the peers' sockets and check the watchdog meanwhile, so they are interruptible. A
peer that dies closes its end: a wait reads the end of the stream and raises ConnectionError, named
like a lost gloo connection (:func:`~launcher.runtime.failure.raise_named`, docs/faults.md).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from .failure import Watchdog, blocked, raise_named
from .shared_links import ALIGN, AREA, SHARE, SUMMED, MappedFile, SharedLinks, aligned

if TYPE_CHECKING:
    from .comm import Clock

# a bucket's state on this worker in a step: its share not complete yet, SHARE sent, its chunk summed
# (SUMMED sent), reduced (every result copied back)
WAITING, SHARED, CHUNK_SUMMED, REDUCED = 0, 1, 2, 3


def chunks(numel: int, n: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each of ``n`` owners' chunks of a bucket of ``numel`` elements: as equal as
    can be, the first ones the larger."""
    q, r = divmod(numel, n)
    out, lo = [], 0
    for i in range(n):
        hi = lo + q + (1 if i < r else 0)
        out.append((lo, hi))
        lo = hi
    return out


class SharedReduce:
    """This worker's all-reduces of its buckets through shared memory (see the module docstring)."""

    def __init__(self, links: SharedLinks, index: Sequence[int], owners: Sequence[tuple[int, ...]],
                 numels: Sequence[int], dtypes: Sequence[torch.dtype], watchdog: Watchdog | None,
                 tag: Callable[[int, int], int], ranks: Sequence[int]) -> None:
        """Per bucket of this worker: its ``index`` among all buckets (the notices' number, the same
        on every owner), its ``owners``, ``numels`` and ``dtypes``. Hands each bucket's buffer to its
        other owners and maps theirs: a set-up exchange among the owners. ``tag(bucket, round)`` and
        ``ranks`` (the workers' ranks) name the notices on a step's clock, as the rounds through a
        root name their messages (:meth:`~launcher.schedule.program.Lowered.reduce_tag`): SHARE is
        round 0, SUMMED round 1."""
        self.links, self.me, self.watchdog = links, links.me, watchdog
        self.tag, self.ranks = tag, list(ranks)
        self.clock: Clock | None = None  # the step's, if it times the rounds
        self.index, self.owners = list(index), [tuple(o) for o in owners]
        self.chunks = [chunks(n, len(o)) for n, o in zip(numels, self.owners)]
        self._mine: list[MappedFile] = []
        for i, numel, dtype in zip(self.index, numels, dtypes):
            k = len(self._mine)
            fd, buf = self._area(k, numel, dtype)
            self._mine.append(buf)
            try:
                for o in self._others(k):
                    links.hand_over(o, AREA, i, fd)
            finally:
                os.close(fd)
        # every owner's (buffer, result area) per bucket, in owner order
        self.views: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        with blocked(watchdog):
            for k, (i, numel, dtype) in enumerate(zip(self.index, numels, dtypes)):
                row = []
                for j, o in enumerate(self.owners[k]):
                    if o == self.me:
                        buf = self._mine[k]
                    else:
                        peer = links.peers[o]
                        links.pump(o, lambda: i in peer.areas)  # noqa: B023 (called at once)
                        buf = peer.areas[i]
                    row.append(self._views(buf, k, j, numel, dtype))
                self.views.append(row)
        # this worker's buffer per bucket: where its gradient accumulates
        self.flats = [row[o.index(self.me)][0] for row, o in zip(self.views, self.owners)]
        self.reset()

    def _area(self, k: int, numel: int, dtype: torch.dtype) -> tuple[int, MappedFile]:
        """A new memory file for bucket ``k``, mapped: the buffer, then this worker's result area
        (its descriptor stays open, to be handed over)."""
        lo, hi = self.chunks[k][self.owners[k].index(self.me)]
        size = self._result_at(numel, dtype) + max(aligned((hi - lo) * dtype.itemsize), ALIGN)
        fd = os.memfd_create("launcher-reduce")
        try:
            os.ftruncate(fd, size)
            return fd, MappedFile(fd, size)
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def _result_at(numel: int, dtype: torch.dtype) -> int:
        return aligned(numel * dtype.itemsize)

    def _views(self, buf: MappedFile, k: int, j: int, numel: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Owner ``j``'s buffer and result area of bucket ``k``, as tensors of ``dtype``."""
        lo, hi = self.chunks[k][j]
        at, e = self._result_at(numel, dtype), dtype.itemsize
        return buf.bytes[:numel * e].view(dtype), buf.bytes[at:at + (hi - lo) * e].view(dtype)

    def _others(self, k: int) -> list[int]:
        return [o for o in self.owners[k] if o != self.me]

    # ---- a step --------------------------------------------------------------------------------
    def reset(self) -> None:
        """A new step: no bucket's share complete, no clock yet (:meth:`Replicas.timed_by
        <launcher.runtime.groups.Replicas.timed_by>`)."""
        self.state = [WAITING] * len(self.index)
        self.clock = None

    def share(self, k: int) -> None:
        """This worker's share of its bucket ``k`` is complete (its buffer holds its gradient)."""
        assert self.state[k] == WAITING
        self._sent(k, 0)
        for o in self._others(k):
            self._notify(o, SHARE, self.index[k])
        self.state[k] = SHARED

    def advance(self, wait: bool) -> None:
        """Sum and gather what the peers' notices allow: with ``wait``, every bucket to its end (every
        share must be complete: each bucket's sum, then each one's gather, so no owner waits for a
        gather while a peer waits for its sum); without, only what is ready now."""
        try:
            for k in range(len(self.index)):
                if self.state[k] == SHARED and self._heard(k, SHARE, wait):
                    self._sum(k)
            for k in range(len(self.index)):
                if self.state[k] == CHUNK_SUMMED and self._heard(k, SUMMED, wait):
                    self._gather(k)
        except Exception as e:  # a peer died or hung: as a lost gloo connection
            raise_named(self.watchdog, e)
        assert not wait or all(s == REDUCED for s in self.state), "advance(wait=True) before every share was complete"

    def _heard(self, k: int, kind: int, wait: bool) -> bool:
        """Whether every other owner's ``kind`` notice of bucket ``k`` has come (waiting for them
        with ``wait``); takes them when so."""
        i = self.index[k]
        others = self._others(k)
        sets = [self.links.peers[o].shared if kind == SHARE else self.links.peers[o].summed for o in others]
        for o, got in zip(others, sets):
            if i not in got:
                if wait:
                    t0 = time.perf_counter()
                    with blocked(self.watchdog):
                        self.links.pump(o, lambda: i in got)  # noqa: B023 (called at once)
                    if self.clock is not None:  # a round the step waited for, since it waited
                        t1 = time.perf_counter()
                        self.clock.arrived(self._key(k, 0 if kind == SHARE else 1, o), t1, t1 - t0, exchange=True)
                else:
                    self.links.pump(o, lambda: i in got, wait=False)  # noqa: B023
                    if i not in got:
                        return False
        for got in sets:
            got.discard(i)
        return True

    def _sum(self, k: int) -> None:
        """Owner ``j`` (this worker) adds chunk ``j`` of every owner's buffer into its result area."""
        j = self.owners[k].index(self.me)
        lo, hi = self.chunks[k][j]
        row = self.views[k]
        out = row[j][1]
        torch.add(row[0][0][lo:hi], row[1][0][lo:hi], out=out)
        for buf, _ in row[2:]:
            out += buf[lo:hi]
        self._sent(k, 1)
        for o in self._others(k):
            self._notify(o, SUMMED, self.index[k])
        self.state[k] = CHUNK_SUMMED

    def _gather(self, k: int) -> None:
        """Every owner's summed chunk into this worker's buffer (every peer has read it: their SUMMED came)."""
        mine = self.flats[k]
        for (lo, hi), (_, result) in zip(self.chunks[k], self.views[k]):
            mine[lo:hi].copy_(result)
        self.state[k] = REDUCED

    def _key(self, k: int, round_: int, sender: int) -> tuple[int, int]:
        return self.tag(self.index[k], round_), self.ranks[sender]

    def _sent(self, k: int, round_: int) -> None:
        if self.clock is not None:
            self.clock.sent(self._key(k, round_, self.me))

    def _notify(self, o: int, kind: int, n: int) -> None:
        try:
            self.links.notify(o, kind, n)
        except OSError:  # the peer's end is closed: it died
            raise_named(self.watchdog, ConnectionError(f"worker {o} closed its link to worker {self.me} "
                                                       "(it stopped or died)"))
